"""The batched sampler (rollart.rollout.sampling): distribution, seeds, greedy, log-probs."""

import pytest
import torch

from rollart.rollout.sampling import inverse_cdf, pick, uniforms

LOGITS = torch.tensor([2.0, 0.3, 1.5, -1.0, 0.9, 2.2, -0.4, 0.0])
DRAWS = 40_000


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The reference distribution: softmax(logits / T), cut to its top-p nucleus (the
    most probable tokens while the mass before them is below top_p), renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    before = 0.0
    for t in order.tolist():
        if before >= top_p and keep.any():
            break
        keep[t] = True
        before += float(p[t])
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def draw(logits: torch.Tensor, temperature: float, top_p: float, seed: int = 0) -> list[int]:
    """DRAWS tokens from one row's distribution, all rows in one batch (one generator)."""
    rng = torch.Generator().manual_seed(seed)
    rows = logits.expand(DRAWS, -1)
    tokens, _ = pick(rows, [temperature] * DRAWS, [top_p] * DRAWS, [rng] * DRAWS)
    return tokens


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8),
                                               (1.3, 0.6), (1.0, 0.3)])
def test_draws_follow_the_nucleus_distribution(temperature, top_p):
    expected = nucleus(LOGITS, temperature, top_p)
    freq = frequencies(draw(LOGITS, temperature, top_p), len(LOGITS))
    # sampling error: TV ~ 0.004 at 40k draws over 8 tokens; a wrong sampler is far off
    assert tv(freq, expected) < 0.015
    assert (freq[expected == 0] == 0).all()  # nothing outside the nucleus, ever


def test_the_check_would_catch_a_sampler_without_truncation_or_temperature():
    """The tolerance above is tight enough: the distributions a wrong sampler would
    draw from (top-p ignored, temperature ignored) are well outside it."""
    freq = frequencies(draw(LOGITS, 1.3, 0.6), len(LOGITS))
    assert tv(freq, nucleus(LOGITS, 1.3, 1.0)) > 0.1  # top-p skipped
    assert tv(freq, nucleus(LOGITS, 1.0, 0.6)) > 0.05  # temperature skipped


def test_rows_with_and_without_top_p_in_one_batch():
    """A batch mixing top_p < 1 with top_p = 1 rows: each row keeps its own nucleus."""
    rng = torch.Generator().manual_seed(1)
    rows = LOGITS.expand(2 * DRAWS, -1)
    tops = [0.5, 1.0] * DRAWS
    tokens, _ = pick(rows, [1.0] * (2 * DRAWS), tops, [rng] * (2 * DRAWS))
    cut, full = tokens[0::2], tokens[1::2]
    assert tv(frequencies(cut, 8), nucleus(LOGITS, 1.0, 0.5)) < 0.015
    assert tv(frequencies(full, 8), nucleus(LOGITS, 1.0, 1.0)) < 0.015


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = LOGITS.expand(64, -1)

    def tokens(seed):
        rngs = [torch.Generator().manual_seed(seed + i) for i in range(64)]
        return pick(logits, [1.0] * 64, [0.9] * 64, rngs)[0]

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(500)


def test_greedy_rows_take_the_argmax_with_temperature_one_logprobs():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3)) * 3
    tokens, logps = pick(logits, [0.0] * 5, [0.5] * 5, [torch.Generator()] * 5)
    assert tokens == torch.argmax(logits, -1).tolist()
    full = torch.log_softmax(logits, -1)
    assert logps == pytest.approx(full[torch.arange(5), tokens].tolist(), abs=1e-6)


def test_a_mixed_batch_matches_each_row_alone():
    """Greedy, seeded (own generator) and unseeded (one shared generator) rows together:
    each seeded row picks what it picks alone, and every log-prob is the full
    (untruncated) temperature-scaled distribution's."""
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(4)) * 2
    temps = [0.0, 1.0, 0.7, 1.0, 0.0, 1.3]
    tops = [1.0, 0.9, 1.0, 0.8, 0.5, 0.7]
    shared = torch.Generator().manual_seed(99)
    seeded = {1: 11, 2: 12, 5: 15}
    rngs = [torch.Generator().manual_seed(seeded[i]) if i in seeded else shared
            for i in range(6)]
    tokens, logps = pick(logits, temps, tops, rngs)
    for i, s in seeded.items():
        alone, lp = pick(logits[i : i + 1], [temps[i]], [tops[i]],
                         [torch.Generator().manual_seed(s)])
        assert tokens[i] == alone[0] and logps[i] == pytest.approx(lp[0], abs=1e-6)
    assert [tokens[0], tokens[4]] == torch.argmax(logits[[0, 4]], -1).tolist()
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps])[:, None]
    full = torch.log_softmax(logits / scale, -1)
    assert logps == pytest.approx(full[torch.arange(6), tokens].tolist(), abs=1e-6)


def test_rows_sharing_a_generator_take_its_draws_in_order():
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    u = uniforms([a, b, a, a, b])
    ref_a = torch.rand(3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref_b = torch.rand(2, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    assert u.tolist() == [ref_a[0], ref_b[0], ref_a[1], ref_a[2], ref_b[1]]


def test_a_draw_at_the_top_picks_a_token_with_mass():
    """u so close to 1 that u x mass rounds to the mass: never a zero-probability token
    (the vocabulary's tail, or one outside the nucleus)."""
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.6, 0.3, 0.0, 0.0]])
    u = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs, torch.tensor([1.0, 1.0], dtype=torch.float64), u).tolist() \
        == [2, 2]
    assert inverse_cdf(probs, torch.tensor([0.6, 0.6], dtype=torch.float64), u).tolist() \
        == [1, 1]
