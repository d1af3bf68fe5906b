"""bench_gpu.py's greedy agreement with HF, counted per position with HF's tokens before it.

A free-running comparison counts every token after a near-tie as wrong. The forced count must
find exactly the positions where the two "models" choose differently on the same context, and
no others, however early the first one is.
"""

import torch

from bench import bench_gpu

VOCAB = 97
STEPS = bench_gpu.AGREEMENT_TOKENS


def reference_next(context: list[int]) -> int:
    return (sum(context) * 31 + 7 * len(context)) % VOCAB


def greedy(prompt: list[int], next_token) -> list[int]:
    sequence = list(prompt)
    for _ in range(STEPS):
        sequence.append(next_token(sequence))
    return sequence


def test_forced_agreement_finds_each_flipped_position_once_where_free_running_loses_the_rest():
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    references = [greedy(prompt, reference_next) for prompt in prompts]
    hf_tokens = [reference[len(prompt):] for prompt, reference in zip(prompts, references)]
    flips = {0: {2, 17}, 1: {STEPS - 1}}  # prompt 2 agrees everywhere

    def ours_next(sequence: list[int]) -> int:
        """reference_next, but another token at a flipped position of the exact reference
        context (as a near-tie that rounding turns)."""
        token = reference_next(sequence)
        for index, reference in enumerate(references):
            position = len(sequence) - len(prompts[index])
            if position in flips.get(index, ()) and sequence == reference[:len(sequence)]:
                return (token + 1) % VOCAB
        return token

    calls: list[int] = []

    def generate(batch: list[list[int]]) -> list[list[int]]:
        calls.append(len(batch))
        return [greedy(prompt, ours_next)[len(prompt):] for prompt in batch]

    found = bench_gpu.forced_divergences(generate, prompts, hf_tokens)

    assert [[position for position, _ in divergences] for divergences in found] == [[2, 17], [STEPS - 1], []]
    assert found[0][0][1] == (hf_tokens[0][2] + 1) % VOCAB  # our token, not HF's
    # Round 1 all three; prompt 1's last-token divergence ends it; prompt 0 resumes twice.
    assert calls == [3, 1, 1]

    scores = [torch.zeros(STEPS, VOCAB) for _ in prompts]
    for tokens, score in zip(hf_tokens, scores):
        score[torch.arange(STEPS), torch.tensor(tokens)] = 0.25
    hf = dict(tokens=hf_tokens, scores=scores)
    total = len(prompts) * STEPS
    forced = bench_gpu.forced_agreement_rows("toy", generate, prompts, hf, ">= 99%")
    assert forced[0][1] == f"{total - 3}/{total} = {(total - 3) / total:.1%}"
    assert forced[1][1] == "0.250, 0.250, 0.250"  # HF's gap at each
    free_running = generate(prompts)
    free = bench_gpu.agreement_rows("toy", free_running, hf, ">= 99%")
    assert free[0][1].startswith(f"{2 + (STEPS - 1) + STEPS}/{total}")  # all after prompt 0's token 2 lost
    # The free-running run stands for the first round: one generate fewer, the same positions.
    calls.clear()
    assert bench_gpu.forced_divergences(generate, prompts, hf_tokens, first_outputs=free_running) == found
    assert calls == [1, 1]


def test_the_fp32_referee_counts_each_bf16_runs_agreement_and_sides_at_each_divergence():
    """referee_rows: the fp32 model's logits for each position of prompt + HF's bf16 tokens; at
    a divergence it prefers the engine's token in one prompt and HF's in the other, and at one
    position where both bf16 runs agree it prefers a third token (both count it as a miss)."""
    prompts = [[1, 2, 3], [4, 5]]
    hf_tokens = [[10, 11, 12, 13], [20, 21, 22, 23]]
    found = [[(1, 50)], [(2, 60)]]  # (position, the engine's token)
    preferred = {(0, 1): 50, (1, 2): 22, (1, 3): 70}  # fp32's choice where it is not HF's token

    def next_logits(sequence: list[int]) -> torch.Tensor:
        index = next(i for i, prompt in enumerate(prompts) if sequence[:len(prompt)] == prompt)
        prompt, tokens = prompts[index], hf_tokens[index]
        assert sequence == prompt + tokens  # teacher-forced on HF's bf16 tokens
        logits = torch.zeros(len(sequence), VOCAB)
        for position, token in enumerate(tokens):
            row = len(prompt) - 1 + position  # the logits for token `position`
            logits[row, token] = 1.0
            logits[row, preferred.get((index, position), token)] = 2.0
            logits[row, 60] = 1.5 if (index, position) == (1, 2) else logits[row, 60]
        logits[-1, 0] = 9.0  # past the last token: ignored
        return logits

    (equal, sides) = bench_gpu.referee_rows("toy", next_logits, prompts, hf_tokens, found)
    # HF's bf16 tokens: all but (0, 1) and (1, 3) are fp32's choice; the engine's: all but (1, 2) and (1, 3).
    assert equal[1] == "6/8 = 75.0% / 6/8 = 75.0%"
    assert sides[1] == "-0.500, +1.000" and sides[2] == "fp32 sides with the engine at 1 of 2"
