"""The allocation's knapsack solvers (torch_lowbit/nn/knapsack.py): the exact one against brute force
on small random instances (one and two constraints), never worse than the greedy one, and the errors."""
import itertools
import random

import pytest

pytest.importorskip("scipy")

from torch_lowbit.nn import knapsack


def _instance(rng, units, options, constraints=1, convex=False):
    losses, costs = [], [[] for _ in range(constraints)]
    for _ in range(units):
        c = sorted(rng.uniform(1, 10) for _ in range(options))
        if convex:  # loss falling as 2^-2c: what bits do to a quantizer's error
            loss = [rng.uniform(0.5, 2) * 2 ** (-2 * x) for x in c]
        else:
            loss = [rng.uniform(0, 5) for _ in c]
        losses.append(loss)
        costs[0].append(c)
        for k in range(1, constraints):
            costs[k].append([rng.uniform(1, 10) for _ in c])
    return losses, costs


def _brute(losses, costs, budgets):
    best = None
    for choice in itertools.product(*(range(len(o)) for o in losses)):
        if all(knapsack.total(t, choice) <= b for t, b in zip(costs, budgets)):
            loss = knapsack.total(losses, choice)
            if best is None or loss < best:
                best = loss
    return best


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("constraints", [1, 2])
def test_exact_is_optimal_on_small_instances(seed, constraints):
    rng = random.Random(1000 * constraints + seed)
    losses, costs = _instance(rng, units=rng.randint(2, 6), options=rng.randint(1, 4), constraints=constraints)
    budgets = [knapsack.total(t, [min(range(len(o)), key=o.__getitem__) for o in t]) + rng.uniform(0, 15)
               for t in costs]
    expect = _brute(losses, costs, budgets)
    if expect is None:  # no choice meets both constraints at once
        with pytest.raises(ValueError):
            knapsack.solve_exact(losses, costs, budgets)
        return
    choice = knapsack.solve_exact(losses, costs, budgets)
    assert all(knapsack.total(t, choice) <= b * (1 + 1e-12) for t, b in zip(costs, budgets))
    assert knapsack.total(losses, choice) == pytest.approx(expect, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("convex", [False, True])
def test_exact_never_worse_than_greedy(seed, convex):
    rng = random.Random(seed + 77)
    losses, costs = _instance(rng, units=40, options=6, convex=convex)
    low = knapsack.total(costs[0], [0] * 40)
    high = knapsack.total(costs[0], [5] * 40)
    budget = rng.uniform(low, high)
    exact = knapsack.solve_exact(losses, costs, [budget])
    greedy = knapsack.solve_greedy(losses, costs, [budget])
    for choice in (exact, greedy):
        assert knapsack.total(costs[0], choice) <= budget * (1 + 1e-12)
    assert knapsack.total(losses, exact) <= knapsack.total(losses, greedy) * (1 + 1e-12)


def test_a_budget_exactly_at_a_plan_is_met_and_the_richest_plan_taken_at_the_top():
    losses = [[3.0, 2.0, 1.0], [5.0, 1.0, 0.5]]
    costs = [[[1.0, 2.0, 3.0], [1.0, 2.5, 4.0]]]
    assert knapsack.solve_exact(losses, costs, [7.0]) == [2, 2]
    assert knapsack.solve_exact(losses, costs, [4.5]) == [1, 1]   # 2 + 2.5, loss 3; (3, 1) costs 4 and loses 4
    assert knapsack.solve_greedy(losses, costs, [7.0]) == [2, 2]


def test_dominated_options_are_dropped():
    losses = [[1.0, 2.0, 0.5, 0.5]]
    costs = [[[1.0, 1.0, 3.0, 3.0]]]
    assert knapsack.dominated(losses, costs, 0) == {1, 3}


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"below the cheapest choice \(3"):
        knapsack.solve_exact([[1.0, 0.0], [1.0]], [[[1.0, 2.0], [2.0]]], [2.0])
    with pytest.raises(ValueError, match="at least one option"):
        knapsack.solve_exact([[1.0], []], [[[1.0], []]], [5.0])
    with pytest.raises(ValueError, match="one cost per unit"):
        knapsack.solve_exact([[1.0, 0.5]], [[[1.0]]], [5.0])
    with pytest.raises(ValueError, match="one constraint"):
        knapsack.solve_greedy([[1.0]], [[[1.0]], [[1.0]]], [5.0, 5.0])
    with pytest.raises(ValueError, match="unknown solver"):
        knapsack.solve([[1.0]], [[[1.0]]], [5.0], solver="dp")


@pytest.mark.parametrize("seed", range(10))
def test_alternatives_pick_the_whole_or_every_part_optimally(seed):
    """Units 0 (whole) | 1, 2 (its parts), 3 and 4 free; two constraints (bits, latency)."""
    rng = random.Random(seed + 500)
    losses, costs = _instance(rng, units=5, options=3, constraints=2)
    alts = [(0, [1, 2])]
    budgets = [rng.uniform(10, 25), rng.uniform(10, 25)]
    best = None
    for choice in itertools.product(*(range(3) for _ in range(5))):
        for fused in (True, False):
            c = list(choice)
            if fused:
                c[1] = c[2] = -1
            else:
                c[0] = -1
            if all(knapsack.total(t, c) <= b for t, b in zip(costs, budgets)):
                loss = knapsack.total(losses, c)
                best = loss if best is None else min(best, loss)
    if best is None:
        with pytest.raises(ValueError):
            knapsack.solve_exact(losses, costs, budgets, alts)
        return
    choice = knapsack.solve_exact(losses, costs, budgets, alts)
    assert (choice[0] >= 0) != (choice[1] >= 0 and choice[2] >= 0) and choice[3] >= 0 and choice[4] >= 0
    assert (choice[0] == -1) == (choice[1] >= 0) == (choice[2] >= 0)
    assert knapsack.total(losses, choice) == pytest.approx(best, rel=1e-12, abs=1e-12)
    greedy = knapsack.solve(losses, costs[:1], [budgets[0] * 2], "greedy", alts)  # the parts, never the whole
    assert greedy[0] == -1 and all(j >= 0 for j in greedy[1:])
    assert greedy[1:] == knapsack.solve_greedy(losses[1:], [costs[0][1:]], [budgets[0] * 2])
    with pytest.raises(ValueError, match="distinct units"):
        knapsack.solve_exact(losses, costs, budgets, [(0, [1, 2]), (2, [3])])


def test_equal_plans_prefer_the_whole_to_its_parts():
    # the parts cost the same and lose the same as the whole: the whole is taken
    losses = [[1.0, 0.5], [0.5, 0.25], [0.5, 0.25]]
    costs = [[[1.0, 2.0], [0.5, 1.0], [0.5, 1.0]]]
    assert knapsack.solve_exact(losses, costs, [10.0], [(0, [1, 2])]) == [1, -1, -1]
