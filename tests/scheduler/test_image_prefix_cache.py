"""The prefix cache and images: placeholder tokens are equal for every image, so the cache keys them on the image's
content hash. Different images never share KV (the simulated worker hashes each placeholder's image into its KV
and fails any step that attends to another image's KV); the same image in the same place does share it."""

from __future__ import annotations

import pytest

from infer_protocol.messages import ImageInput
from infer_scheduler.request import image_key_id

from .conftest import make_engine, make_submit
from .sim_worker import SimWorker, run_to_completion

PAD = 9  # the placeholder token id
BS = 4


def image(offset: int, num_tokens: int, content_hash: str) -> ImageInput:
    return ImageInput(offset=offset, num_tokens=num_tokens, grid_thw=(1, 2, 2 * num_tokens), patches=b"\0" * 2,
                      shape=(1, 2), value_table=b"\0" * 3 * 256 * 4, content_hash=content_hash)


def prompt_with_image(offset: int = 8, num_tokens: int = 6, tail: int = 6) -> list[int]:
    """Text tokens, the image's placeholders from `offset`, then text again: 2 + 1.5 + 1.5 pages of 4."""
    return list(range(1, offset + 1)) + [PAD] * num_tokens + list(range(50, 50 + tail))


def hit_of_second(first_hash: str, second_hash: str, *, offset: int = 8) -> tuple[int, list[ImageInput]]:
    """Run a request with an image to completion, then admit the same prompt with another (or the same) image:
    the second one's prefix-cache hit and the images its NewSeq carries."""
    e = make_engine(block_size=BS)
    w = SimWorker(64, BS)
    prompt = prompt_with_image(offset)
    e.submit(make_submit(prompt, max_tokens=2, images=[image(offset, 6, first_hash)]))
    run_to_completion(e, w)
    e.submit(make_submit(prompt, max_tokens=2, images=[image(offset, 6, second_hash)]))
    plan = e.plan_step()
    ns, = plan.new_seqs
    w.step(plan)  # the simulated worker checks that every position it attends to holds its own image's KV
    return ns.num_computed, ns.images


def test_the_same_image_in_the_same_place_shares_its_pages() -> None:
    hit, images = hit_of_second("aa" * 16, "aa" * 16)
    assert hit == 16  # 20 prompt tokens: every full page but the last token's
    assert images == [image(8, 6, "aa" * 16)]


def test_another_image_shares_only_the_pages_before_it() -> None:
    hit, images = hit_of_second("aa" * 16, "bb" * 16)
    assert hit == 8  # the two text pages; the image starts the third
    assert images[0].content_hash == "bb" * 16


def test_a_page_that_holds_text_and_the_start_of_an_image_is_not_shared() -> None:
    hit, _ = hit_of_second("aa" * 16, "bb" * 16, offset=6)  # page 2 holds tokens 4..7: text 4, 5, image 6, 7
    assert hit == 4


def test_text_only_prompts_equal_to_the_placeholders_do_not_hit_an_image() -> None:
    e = make_engine(block_size=BS)
    w = SimWorker(64, BS)
    prompt = prompt_with_image()
    e.submit(make_submit(prompt, max_tokens=2, images=[image(8, 6, "aa" * 16)]))
    run_to_completion(e, w)
    e.submit(make_submit(prompt, max_tokens=2))  # the same ids, no image (a raw completion prompt)
    plan = e.plan_step()
    assert plan.new_seqs[0].num_computed == 8
    w.step(plan)


def test_images_survive_preemption_and_stay_keyed() -> None:
    e = make_engine(num_blocks=8, block_size=BS)  # two prompts of 14 tokens fill 8 blocks: decoding preempts one
    w = SimWorker(8, BS)
    for h in ("aa" * 16, "bb" * 16):
        e.submit(make_submit(prompt_with_image(4, 6, 4), max_tokens=6, images=[image(4, 6, h)]))
    outs = run_to_completion(e, w)
    assert len(outs) == 2 and all(o[-1].finish_reason == "length" for o in outs.values())
    assert e.counters.preemptions >= 1
    new_seqs = [ns for plan in w.plans for ns in plan.new_seqs]
    assert len(new_seqs) > 2  # a recompute
    assert all(len(ns.images) == 1 and ns.images[0].offset == 4 for ns in new_seqs)


def test_key_ids_are_negative_and_differ_per_image() -> None:
    a, b = image_key_id("aa" * 16), image_key_id("ab" * 16)
    assert a < -1 and b < -1 and a != b


@pytest.mark.parametrize("images", [
    [image(18, 6, "aa" * 16)],  # past the prompt's end
    [image(8, 6, "aa" * 16), image(10, 2, "bb" * 16)],  # overlapping
    [image(8, 0, "aa" * 16)],  # empty
])
def test_image_spans_outside_the_prompt_are_refused(images: list[ImageInput]) -> None:
    e = make_engine(block_size=BS)
    err = e.submit(make_submit(prompt_with_image(), images=images))
    assert err is not None and err.code == "invalid_request" and "placeholders" in err.message
