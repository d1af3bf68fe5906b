"""CUDA graphs under tensor parallelism (replica/parallel/graphs.py).

On the CPU: the ranks' start-up agreement over a real 2-rank gloo group (graphs only if every
rank would capture them, a different ladder failing both ranks' start together, never one
waiting for the other) and the ladder and capture order as functions of the config alone.
test_tensor_parallel.py checks the rest a CPU can run: graphs off on every rank, both ranks
padding each decode step to the size rank 0 padded it to, padded steps casting no vote.

With HEADROOM_TEST_DEVICE=cuda on a machine with >= 2 GPUs (NCCL): TP=2 captures its decode
graphs on both ranks in the same order and replays them in lockstep, greedy tokens equal to
TP=1's. No such machine has run it yet; bench/bench_gpu.py --sections tp runs it. On the CPU,
test_cuda_runtime_on_cpu.py runs the same path on two gloo ranks under an emulated CUDA runtime
(graphs recorded op by op, collectives included, and replayed).
"""

from __future__ import annotations

import os

import pytest
import torch

from replica.config import make_engine_config
from replica.core.engine import LLMEngine
from replica.core.request import SamplingParams
from replica.executor.cuda_graphs import capture_order, capture_sizes
from replica.parallel.graphs import agree_on_decode_graphs
from replica.parallel.group import TensorParallelConfigError, join_group, rendezvous_store
from tests.replica.tp_harness import beside_rank_1

pytestmark = pytest.mark.timeout(120)  # a hung collective fails its test instead of the run

LADDER = capture_sizes(16, 2048)
# (rank 0's decision and ladder, rank 1's), in the order both ranks call the agreement.
CASES = [((True, LADDER), (True, LADDER)), ((True, LADDER), (False, LADDER)),
         ((False, LADDER), (False, LADDER)), ((True, LADDER), (True, capture_sizes(24, 2048)))]


def agree(tp, cuda_graphs, sizes):
    """What this rank's agreement answers, or the error it raises."""
    try:
        return agree_on_decode_graphs(tp, cuda_graphs, sizes, torch.device("cpu"))
    except TensorParallelConfigError as error:
        return str(error)


def _rank_1_agrees(rendezvous: str, results) -> None:
    tp = join_group(rendezvous_store(2, rendezvous), 1, 2, torch.device("cpu"), 30.0)
    for _, (cuda_graphs, sizes) in CASES:
        results.put(agree(tp, cuda_graphs, sizes))


def test_the_ranks_capture_only_if_all_would_and_a_different_ladder_fails_every_ranks_start():
    with beside_rank_1(_rank_1_agrees) as (tp, results):
        answers = [(agree(tp, *ours), results.get(timeout=60)) for ours, _ in CASES]
    assert answers[:3] == [(True, True), (False, False), (False, False)]
    ours, theirs = answers[3]  # ladders to 16 and to 24 sequences: both ranks refuse to start
    assert ours.startswith("max_num_seqs / max_num_batched_tokens: the 2 tensor-parallel ranks would pad")
    assert "rank 0's: [1, 2, 4, 8, 16]" in ours and "rank 1's: [1, 2, 4, 8, 16, 24]" in theirs


def test_the_ladder_and_its_capture_order_follow_from_the_config_alone():
    """Every rank derives both from the same two config fields: equal configs, equal ladders."""
    assert LADDER == [1, 2, 4, 8, 16] and capture_order(LADDER) == [16, 8, 4, 2, 1]
    assert capture_sizes(256, 2048) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(300, 100) == [1, 2, 4] + list(range(8, 100, 8)) + [100]  # the token budget caps it
    assert capture_order(capture_sizes(256, 2048))[:3] == [256, 248, 240]


TEST_DEVICE = os.environ.get("HEADROOM_TEST_DEVICE", "cpu")


@pytest.mark.skipif(TEST_DEVICE != "cuda" or torch.cuda.device_count() < 2,
                    reason="needs HEADROOM_TEST_DEVICE=cuda and >= 2 GPUs (NCCL)")
@pytest.mark.timeout(600)
def test_tp2_replays_decode_graphs_on_both_ranks_in_lockstep_with_tp1s_greedy_tokens():
    config = dict(max_model_len=256, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256)
    prompts = [[(7 * index + 3 * position) % 256 for position in range(8 + 9 * index)] for index in range(7)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tp1 = LLMEngine(make_engine_config(**config), "builtin", device="cuda", dtype="float32")
    try:
        assert tp1.runner.graphs is not None
        expected = tp1.generate(prompts, params)
    finally:
        tp1.shutdown()
    tp2 = LLMEngine(make_engine_config(**config, tensor_parallel_size=2), "builtin", device="cuda", dtype="float32")
    try:
        runner = tp2.runner
        (before,) = tp2.tp_workers.call("stats")
        assert runner.graphs is not None and before["cuda_graphs"], "a rank did not capture"
        assert before["capture_order"] == runner.graphs.captured == capture_order(capture_sizes(8, 256))
        requests = [tp2.make_request(f"g{index}", prompt, params) for index, prompt in enumerate(prompts)]
        for request in requests:
            tp2.add_request(request, detokenize=False)
        replayed = []
        while tp2.has_unfinished_requests():
            tp2.step()
            if tp2.last_step.graph_batch_size is not None:
                replayed.append(tp2.last_step.graph_batch_size)
        (after,) = tp2.tp_workers.call("stats")
        assert len(replayed) > 10, "no decode graph was replayed"
        assert after["padded_decode_steps"] - before["padded_decode_steps"] == len(replayed)
        assert after["graph_sizes"][-len(replayed):] == replayed, "the worker replayed other sizes than rank 0"
        assert [request.output_token_ids for request in requests] == expected
    finally:
        tp2.shutdown()
