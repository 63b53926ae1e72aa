"""Three definitions of accept length, from the same counts: tau (vLLM / SGLang, bonus token
counted), SpecForge's simulated_acc_len (no bonus token) and vLLM's logged draft acceptance rate."""

import random

import pytest

from draftport.evaluation.accept import acceptance_rate, simulated_acc_len, summarize

K = 3


def test_all_accepted():
    s = summarize([K] * 10, [K] * 10, K)
    assert s["accept_length"] == 1 + K
    assert s["simulated_acc_len"] == pytest.approx(K)
    assert s["acceptance_rate"] == 1.0
    assert [s[f"cond_acc_{i}"] for i in range(K)] == [1.0] * K


def test_none_accepted():
    s = summarize([0] * 7, [0] * 7, K)
    assert s["accept_length"] == 1.0
    assert s["simulated_acc_len"] == 0.0
    assert s["acceptance_rate"] == 0.0
    assert [s[f"accept_rate_pos_{i}"] for i in range(K)] == [0.0] * K


def test_a_known_mix_by_hand():
    # one cycle of each: 0, 1, 2, 3 accepted; 6 accepted of 4 x 3 = 12 drafted
    s = summarize([0, 1, 2, 3], [0, 1, 2, 3], K)
    assert s["accept_length"] == pytest.approx(1 + 6 / 4)  # 2.5
    assert [s[f"accept_rate_pos_{i}"] for i in range(K)] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert [s[f"cond_acc_{i}"] for i in range(K)] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    # 0.75 + 0.75 * 2/3 + 0.75 * 2/3 * 1/2 = 0.75 + 0.5 + 0.25
    assert s["simulated_acc_len"] == pytest.approx(1.5)
    assert s["acceptance_rate"] == pytest.approx(6 / 12)


def test_existing_keys_are_unchanged():
    s = summarize([0, 1, 2, 3], [0, 1, 2, 3, 3], K)
    assert s["num_cycles"] == 4 and s["num_draft_tokens"] == 12 and s["num_accepted_tokens"] == 6
    assert s["accept_length_all_positions"] == pytest.approx(1 + 9 / 5)
    assert s["k"] == K
    assert set(s) == {
        "accept_length",
        "num_cycles",
        "num_draft_tokens",
        "num_accepted_tokens",
        "accept_length_all_positions",
        "k",
        "simulated_acc_len",
        "acceptance_rate",
        *(f"accept_rate_pos_{i}" for i in range(K)),
        *(f"cond_acc_{i}" for i in range(K)),
    }


@pytest.mark.parametrize("seed", range(20))
def test_the_three_relate_as_they_must(seed):
    """k drafts every cycle: acceptance_rate = (tau - 1) / k, and SpecForge's product of the
    conditional rates telescopes to the per-position rates: simulated_acc_len = tau - 1."""
    rng = random.Random(seed)
    k = rng.randint(1, 8)
    cycles = [rng.choice([0, k, rng.randint(0, k)]) for _ in range(rng.randint(1, 300))]
    s = summarize(cycles, cycles, k)
    tau = s["accept_length"]
    assert s["simulated_acc_len"] == pytest.approx(tau - 1, abs=1e-12)
    assert s["acceptance_rate"] == pytest.approx((tau - 1) / k, abs=1e-12)
    assert s["simulated_acc_len"] == pytest.approx(sum(s[f"accept_rate_pos_{i}"] for i in range(k)), abs=1e-12)


def test_no_cycles_divides_by_nothing():
    s = summarize([], [], K)
    assert (s["accept_length"], s["simulated_acc_len"], s["acceptance_rate"]) == (1.0, 0.0, 0.0)


def test_simulated_acc_len_is_specforges_running_product():
    # a0 + a0*a1 over per-position accuracies 0.8, 0.4 (SpecForge's evaluator test): 1.12
    assert simulated_acc_len([0.8, 0.4]) == pytest.approx(1.12)
    assert simulated_acc_len([]) == 0.0
    assert simulated_acc_len([0.5, 0.0, 1.0]) == pytest.approx(0.5)


def test_acceptance_rate_is_accepted_over_draft_tokens():
    assert acceptance_rate(12, 30) == pytest.approx(0.4)
    assert acceptance_rate(0, 0) == 0.0
