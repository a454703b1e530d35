"""Where the model's files are: the `model` config value as a local directory, or as a Hugging Face Hub repo id
fetched into (or found in) huggingface_hub's cache.

huggingface_hub itself honours HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE (no network: the
cache only) and HF_TOKEN (private and gated repos), and draws its download progress bars on stderr. Both the
launcher (before it starts the processes, so errors and progress come first) and the worker call
`resolve_model_source`; the second call finds everything in the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from infer_protocol.config import hub_repo_id

from infer_worker.infrastructure.weight_loader import INDEX_FILE

# The files the engine reads besides the weights: config.json (the worker's model loader), the safetensors
# index, tokenizer.json + tokenizer_config.json and the chat template (the server), generation_config.json (EOS
# ids and sampling defaults). Whatever else a repo holds (other weight formats, READMEs) is never fetched.
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


class ModelSourceError(ValueError):
    """The model cannot be found or fetched; the message says why in one line."""


def resolve_model_source(model: str, revision: str = "") -> Path:
    """The local directory holding the model's files. `model` is an existing directory, else a Hub repo id
    (`owner/name`, at `revision`: a branch, tag or commit, "" = main) found in or downloaded into
    huggingface_hub's cache (returned as its snapshot directory there)."""
    repo_id = hub_repo_id(model)
    if repo_id is not None:
        return _fetch_from_hub(repo_id, revision)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelSourceError(f"model directory not found: {model} (nor is it a Hugging Face Hub id, owner/name)")
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model directory {path} has no config.json (expected a Hugging Face model directory)")
    return path


def _weight_patterns(snapshot: Path) -> list[str]:
    """The shards the index names (a repo may hold other safetensors beside them, such as a consolidated copy),
    else every safetensors file, as the weight loader reads them."""
    index = snapshot / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelSourceError(f"{index} has no weight_map")
        return sorted(set(weight_map.values()))
    return ["*.safetensors"]


def _fetch_from_hub(repo_id: str, revision: str) -> Path:
    # Imported here: a local directory (and the launcher's start for one) does not pay for huggingface_hub.
    from huggingface_hub import constants, errors, snapshot_download

    cache = constants.HF_HUB_CACHE
    at = f" at revision {revision}" if revision else ""
    metadata: Path | None = None  # once it is there, a file missing offline is an interrupted download
    try:
        # Metadata first: the safetensors index says which weight files to fetch. The second call names the commit
        # the first resolved, so a branch that moves in between cannot mix two commits' files.
        metadata = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(METADATA_FILES)))
        snapshot = Path(snapshot_download(repo_id, revision=metadata.name, allow_patterns=_weight_patterns(metadata)))
    except errors.LocalEntryNotFoundError as exc:
        if constants.is_offline_mode():
            # newer huggingface_hub releases also say so when the metadata files are the ones missing
            partial = metadata is not None or isinstance(exc, getattr(errors, "IncompleteSnapshotError", ()))
            where = "is only partly in" if partial else "is not in"
            raise ModelSourceError(f"model {repo_id}{at} {where} the Hugging Face cache {cache} and HF_HUB_OFFLINE "
                                   f"is set (it is not a local directory either)") from None
        cause = exc.__cause__ or exc
        raise ModelSourceError(f"cannot download model {repo_id}{at} from the Hugging Face Hub "
                               f"({_first_line(cause)}) and it is not in the cache {cache}") from None
    except errors.GatedRepoError:
        raise ModelSourceError(f"model {repo_id} is gated on the Hugging Face Hub: accept its terms on the Hub and "
                               f"set HF_TOKEN") from None
    except errors.RevisionNotFoundError:
        raise ModelSourceError(f"model {repo_id} has no revision {revision} on the Hugging Face Hub") from None
    except errors.RepositoryNotFoundError:
        raise ModelSourceError(f"model {repo_id} not found on the Hugging Face Hub (nor a local directory; a private "
                               f"repo needs HF_TOKEN)") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:  # Hub errors, a full disk, an id the Hub refuses
        raise ModelSourceError(f"cannot fetch model {repo_id}{at} from the Hugging Face Hub: "
                               f"{_first_line(exc)}") from None
    if not (snapshot / "config.json").is_file():
        raise ModelSourceError(f"model {repo_id}{at} has no config.json (expected a Hugging Face model repo)")
    return snapshot


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
