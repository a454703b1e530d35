"""Qwen3.5 with images against transformers on one tiny random checkpoint in the published layout (a vision tower
under `model.visual.`), the patches and placeholders made by the server's own preprocessing: fp32 logits close
and greedy tokens identical to `generate` with the same pixel values and grids, for one and two images, over
prefill chunks that cut through an image, in a batch next to text prompts, after preemption, and with the graph
runner (image prefill eager, decodes replayed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from infer_protocol.messages import ContinueSeq, ImageInput, NewSeq, SamplingParams, StepPlan
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.image_inputs import ImageInputs
from infer_worker.application.model_runner import prepare_step
from infer_worker.application.worker_service import WorkerService
from infer_worker.domain.sequence import GREEDY, ScheduledSeq, Sequence
from infer_worker.models.spec import ModelSpec
from tests.worker.image_prompts import (IMAGE_PAD, ONE, SPEC, TWO, VISION_END, VISION_START, float_patches,
                                        image_prompt, text)
from tests.worker.qwen3_5_checkpoints import VISION, load_hybrid, qwen3_5_vl_config, random_qwen3_5
from tests.worker.test_graph_runner import ReplayingCpuBackend
from tests.worker.tiny_checkpoints import Engine, forward_step, greedy_steps

DECODE_STEPS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3_5ForConditionalGeneration]:
    path = tmp_path_factory.mktemp("qwen3_5_vl")
    model = random_qwen3_5(qwen3_5_vl_config(IMAGE_PAD, VISION_START, VISION_END), seed=5)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_inputs(prompt: list[int], images: list[ImageInput]) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": torch.tensor([prompt])}
    if images:
        per_channel = SPEC.temporal_patch_size * SPEC.patch_size**2
        inputs["pixel_values"] = torch.cat([torch.from_numpy(float_patches(im, per_channel)) for im in images])
        inputs["image_grid_thw"] = torch.tensor([im.grid_thw for im in images])
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_PAD).int()  # 1: an image's token
    return inputs


def hf_greedy(hf: Qwen3_5ForConditionalGeneration, prompt: list[int], images: list[ImageInput],
              steps: int = DECODE_STEPS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**hf_inputs(prompt, images), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def engine_with_images(path: Path) -> Engine:
    engine = Engine.open(path, num_blocks=128, max_blocks_per_seq=48)
    assert engine.model.visual is not None
    engine.runner.images = ImageInputs(engine.model.visual, multimodal_rope=bool(engine.spec.mrope_section))
    return engine


def admit(engine: Engine, seq_id: int, prompt: list[int], images: list[ImageInput]) -> Sequence:
    seq = engine.new_seq(seq_id, prompt)
    assert engine.runner.images is not None
    engine.runner.images.admit(seq, images)
    return seq


def test_the_checkpoint_loads_its_vision_tower_and_multimodal_rope(checkpoint) -> None:
    path, _ = checkpoint
    engine = Engine.open(path)
    assert engine.spec.vision is not None and engine.spec.vision.depth == VISION["depth"]
    assert engine.spec.mrope_section == (2, 1, 1)
    assert engine.model.visual is not None


def test_the_spec_refuses_an_mrope_section_that_does_not_split_the_rotary_frequencies() -> None:
    config = qwen3_5_vl_config(IMAGE_PAD, VISION_START, VISION_END).to_dict()
    assert ModelSpec.from_hf_config(config).mrope_section == (2, 1, 1)
    config["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 1]  # 5 of the 4 frequencies
    with pytest.raises(ValueError, match=r"mrope_section \[2, 2, 1\] must split the 4 rotary frequencies"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("parts", [ONE, TWO], ids=["one_image", "two_images"])
def test_logits_and_greedy_tokens_match_transformers(checkpoint, parts) -> None:
    path, hf = checkpoint
    prompt, images = image_prompt(parts)
    with torch.no_grad():
        expected = hf(**hf_inputs(prompt, images)).logits[0].float()
    engine = engine_with_images(path)
    seq = admit(engine, 0, prompt, images)
    seq.block_ids = [engine.free_blocks.pop() for _ in range(-(-len(prompt) // engine.block_size))]
    scheduled = [ScheduledSeq(seq, len(prompt))]
    step = prepare_step(scheduled, engine.block_size, engine.runner.max_blocks_per_seq)
    assert engine.runner.images is not None
    inputs = engine.runner.images.step(scheduled, step.query_start_loc)
    logits = engine.model.compute_logits(forward_step(engine.runner, step, inputs))
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)

    engine = engine_with_images(path)
    seq = admit(engine, 0, prompt, images)
    engine.step([(seq, len(prompt))])
    engine.decode([seq], DECODE_STEPS - 1)
    assert seq.rope_delta < 0  # the images' positions are fewer than their tokens
    assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, images)


def test_an_image_prompt_across_prefill_chunks_matches_transformers(checkpoint) -> None:
    """Chunks of 4 tokens: both images' placeholders (6 tokens each) are cut by chunk ends; each image goes
    through the tower once, when a chunk first reaches it, and its rows are consumed over two steps."""
    path, hf = checkpoint
    prompt, images = image_prompt(TWO)
    with torch.no_grad():
        expected = hf(**hf_inputs(prompt, images)).logits[0].float()
    engine = engine_with_images(path)
    seq = admit(engine, 0, prompt, images)
    assert engine.runner.images is not None
    embeddings = engine.runner.images.embeddings
    cached = []
    for start in range(0, len(prompt), 4):
        num_new = min(4, len(prompt) - start)
        while len(seq.block_ids) < -(-(start + num_new) // engine.block_size):
            seq.block_ids.append(engine.free_blocks.pop())
        scheduled = [ScheduledSeq(seq, num_new)]
        step = prepare_step(scheduled, engine.block_size, engine.runner.max_blocks_per_seq)
        logits = engine.model.compute_logits(
            forward_step(engine.runner, step, engine.runner.images.step(scheduled, step.query_start_loc)))
        torch.testing.assert_close(logits, expected[start:start + num_new], atol=2e-4, rtol=2e-4)
        cached.append(embeddings.num_cached)
        seq.num_computed += num_new
    # images at [4, 10) and [16, 22): each held from the chunk that first reaches it to the one that ends it
    assert cached == [0, 1, 0, 0, 1, 0, 0]
    seq.token_ids.append(int(logits[-1].argmax()))
    engine.decode([seq], DECODE_STEPS - 1)
    assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, images)


def test_a_batch_of_image_and_text_prompts_gives_each_its_solo_tokens(checkpoint) -> None:
    path, hf = checkpoint
    prompts = [image_prompt(ONE), (text(9, 7), []), image_prompt(TWO), (text(4, 8), [])]
    engine = engine_with_images(path)
    seqs = [admit(engine, i, prompt, images) for i, (prompt, images) in enumerate(prompts)]
    engine.step([(seqs[0], 10), (seqs[1], 9), (seqs[2], 7)])
    engine.step([(seqs[0], len(prompts[0][0]) - 10), (seqs[1], 1), (seqs[2], len(prompts[2][0]) - 7),
                 (seqs[3], 4)])
    engine.decode(seqs[:3], 1)
    engine.decode(seqs, DECODE_STEPS - 2)
    for seq, (prompt, images) in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, images, len(seq.token_ids) - len(prompt))


def test_a_preempted_image_sequence_recomputes_from_its_new_seq(checkpoint) -> None:
    """Through the worker service: admitted with its images, decoded, preempted (its images forgotten), admitted
    again with prompt and generated tokens in one chunk: its tokens go on as transformers' do."""
    path, hf = checkpoint
    prompt, images = image_prompt(ONE)
    engine = engine_with_images(path)
    service = WorkerService(engine.runner, images=engine.runner.images)
    blocks = [engine.free_blocks.pop() for _ in range(-(-(len(prompt) + DECODE_STEPS) // engine.block_size))]
    greedy = SamplingParams(temperature=0.0)

    def new_seq(step: int, tokens: list[int]) -> StepPlan:
        return StepPlan(step=step, new_seqs=[NewSeq(
            seq_id=1, token_ids=tokens, num_computed=0, num_tokens=len(tokens), block_ids=blocks, sampling=greedy,
            num_generated=len(tokens) - len(prompt), state_slot=1, images=images)])

    out = [service.step(new_seq(1, prompt)).token_ids[0]]
    for step in range(2, 5):
        out += service.step(StepPlan(step=step, continuing=[ContinueSeq(1, 1, [])])).token_ids
    assert engine.runner.images is not None and engine.runner.images.num_sequences == 1
    out += service.step(StepPlan(step=5, preempted=[1], new_seqs=new_seq(5, prompt + out).new_seqs)).token_ids
    for step in range(6, 5 + DECODE_STEPS - len(out) + 1):
        out += service.step(StepPlan(step=step, continuing=[ContinueSeq(1, 1, [])])).token_ids
    assert out == hf_greedy(hf, prompt, images)
    service.step(StepPlan(step=99, finished=[1]))
    assert engine.runner.images.num_sequences == 0


def test_image_prefill_runs_eagerly_and_its_decodes_replay_graphs(checkpoint) -> None:
    """With the graph runner (a CPU backend whose graphs replay the captured step): steps with image prompt tokens
    run eagerly, the one computing each prompt's last token too (decode-shaped, but that token's rotary row is a
    3-D position's); every decode step after, the image sequences' positions shifted by their delta, replays a
    graph."""
    path, hf = checkpoint
    backend = ReplayingCpuBackend()
    model, caches = load_hybrid(path, backend, 48, 4, 4)
    runner = GraphModelRunner(model, backend, caches.per_layer, 4, 12, "cpu", state_pools=caches.state_pools,
                              capture_sizes=[1, 2, 4])
    runner.capture()
    assert model.visual is not None
    runner.images = ImageInputs(model.visual, multimodal_rope=True)
    prompts = [image_prompt(ONE), (text(9, 7), []), image_prompt(TWO)]
    seqs = []
    for i, (prompt, images) in enumerate(prompts):
        seq = Sequence(i, list(prompt), 0, list(range(i * 12, (i + 1) * 12)), GREEDY, state_slot=i + 1)
        runner.images.admit(seq, images)
        seqs.append(seq)
    runner.execute([ScheduledSeq(seq, seq.num_tokens - 1) for seq in seqs])
    for seq in seqs:
        seq.num_computed = seq.num_tokens - 1
    greedy_steps(runner, seqs, DECODE_STEPS)
    assert (runner.eager_steps, runner.graph_steps) == (2, DECODE_STEPS - 1)
    for seq, (prompt, images) in zip(seqs, prompts):
        assert seq.token_ids[len(prompt):] == hf_greedy(hf, prompt, images)
