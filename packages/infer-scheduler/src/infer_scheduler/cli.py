"""`rustinfer-scheduler --config FILE [--<field> VALUE ...]`: run the scheduler process until SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

from infer_protocol.config import ConfigError
from infer_protocol.config_cli import add_config_arguments, load_config_from_args

PROG = "rustinfer-scheduler"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="RustInfer scheduler: batching, KV blocks, prefix cache.")
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = load_config_from_args(args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s scheduler %(name)s: %(message)s")

    from infer_scheduler.service import Service  # zmq only once the config is good

    try:
        service = Service(config)
    except Exception as exc:  # e.g. the ipc dir does not exist or is not writable
        print(f"{PROG}: error: cannot start: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logging.getLogger(PROG).info("received %s", signal.Signals(signum).name)
        service.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    service.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
