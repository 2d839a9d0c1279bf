"""The multiple-choice knapsack behind per-layer format allocation: each unit (a layer, or a fused
q/k/v or gate/up group) takes exactly one of its options; option j of unit u costs cost[c][u][j]
under each constraint c (bits, or measured latency) and predicts loss[u][j]; minimise Σ loss with
Σ cost[c] ≤ budget[c] for every c.

    solve_exact:  an integer program over binary x[u, j] (one per unit: Σ_j x = 1) solved to
                  optimality by HiGHS branch and bound (scipy.optimize.milp, relative gap 0);
                  any number of constraints.
    solve_greedy: every unit starts at its cheapest option (first constraint), then the upgrade with
                  the largest loss decrease per added cost that still fits is taken until none fits
                  (one constraint). Optimal up to the last unit that did not fit when each unit's
                  options are convex; the fallback without scipy.

Alternatives (exact solver): (whole, parts) says that exactly one of "an option of unit `whole`" and
"an option of every unit in `parts`" is taken (a fused q/k/v module in one format, or q, k and v
each in its own); the units left out are -1 in the result.

Options that another option of the same unit dominates (no more cost under every constraint, no more
loss, one of them strictly less) are dropped first: neither solver would take them."""
from __future__ import annotations

from typing import Optional, Sequence

Table = Sequence[Sequence[float]]  # [unit][option]
PARTS_TIE_BREAK = 1e-9  # objective cost of an alternative's parts, relative to the largest loss


def check_problem(losses: Table, costs: Sequence[Table], budgets: Sequence[float],
                  alternatives: Sequence[tuple[int, Sequence[int]]] = ()) -> None:
    """Raises ValueError naming what is inconsistent, or which budget no choice meets and the
    smallest one that some choice meets (each unit at its cheapest option under that constraint)."""
    if not losses or any(len(opts) == 0 for opts in losses):
        raise ValueError("knapsack: every unit needs at least one option")
    if len(costs) != len(budgets) or not costs:
        raise ValueError(f"knapsack: {len(costs)} cost tables for {len(budgets)} budgets")
    for c, table in enumerate(costs):
        if len(table) != len(losses) or any(len(a) != len(b) for a, b in zip(table, losses)):
            raise ValueError(f"knapsack: cost table {c} does not have one cost per unit and option")
    grouped = [u for whole, parts in alternatives for u in (whole, *parts)]
    if len(grouped) != len(set(grouped)) or any(not 0 <= u < len(losses) for u in grouped) or \
            any(not parts for _, parts in alternatives):
        raise ValueError("knapsack: alternatives must name distinct units, each with at least one part")
    grouped_set = set(grouped)
    for c, (table, budget) in enumerate(zip(costs, budgets)):
        least = sum(min(opts) for u, opts in enumerate(table) if u not in grouped_set) + \
            sum(min(min(table[whole]), sum(min(table[p]) for p in parts)) for whole, parts in alternatives)
        if least > budget + _tolerance(budget):
            raise ValueError(f"knapsack: budget {budget:g} of constraint {c} is below the cheapest choice "
                             f"({least:g}: every unit at its cheapest option)")


def dominated(losses: Table, costs: Sequence[Table], unit: int) -> set[int]:
    """Options of `unit` that another of its options dominates (module doc); of exact ties, all but
    the first."""
    n = len(losses[unit])
    key = [(tuple(t[unit][j] for t in costs), losses[unit][j]) for j in range(n)]
    out = set()
    for j in range(n):
        for i in range(n):
            if i == j or i in out:
                continue
            ci, li = key[i]
            cj, lj = key[j]
            if all(a <= b for a, b in zip(ci, cj)) and li <= lj and ((ci, li) != (cj, lj) or i < j):
                out.add(j)
                break
    return out


def solve_exact(losses: Table, costs: Sequence[Table], budgets: Sequence[float],
                alternatives: Sequence[tuple[int, Sequence[int]]] = (), time_limit: Optional[float] = 60.0) -> list[int]:
    """The optimal option per unit (module doc; -1 for units an alternative left out). Needs scipy
    (>= 1.9: `pip install scipy`)."""
    check_problem(losses, costs, budgets, alternatives)
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array
    except ImportError as e:  # pragma: no cover - scipy is in the [eval] and [msq] extras
        raise ImportError("the exact allocation solver needs scipy >= 1.9 (pip install scipy, or "
                          "pip install torch_lowbit[msq]); solver='greedy' runs without it") from e
    drop = [dominated(losses, costs, u) for u in range(len(losses))]
    keep = [[j for j in range(len(opts)) if j not in drop[u]] for u, opts in enumerate(losses)]
    var_unit, var_opt = [], []
    for u, js in enumerate(keep):
        var_unit += [u] * len(js)
        var_opt += js
    n = len(var_unit) + len(alternatives)  # then one indicator per alternative: "the parts are taken"
    # scale each row to O(1) so HiGHS's absolute tolerances mean the same for bits and for seconds
    loss_scale = max(max(abs(v) for v in opts) for opts in losses) or 1.0
    # taking an alternative's parts costs a hair more than its whole: of equal plans, the one with fewer modules
    objective = np.array([losses[u][j] / loss_scale for u, j in zip(var_unit, var_opt)] +
                         [PARTS_TIE_BREAK] * len(alternatives))
    rows_i, cols_i, vals = list(var_unit), list(range(len(var_unit))), [1.0] * len(var_unit)
    rhs = np.ones(len(keep))
    for g, (whole, parts) in enumerate(alternatives):
        z = len(var_unit) + g
        rows_i.append(whole), cols_i.append(z), vals.append(1.0)  # Σ x[whole] + z = 1
        for p in parts:  # Σ x[part] - z = 0
            rows_i.append(p), cols_i.append(z), vals.append(-1.0)
            rhs[p] = 0.0
    one_each = csr_array((np.array(vals), (np.array(rows_i), np.array(cols_i))), shape=(len(keep), n))
    options = {"mip_rel_gap": 0.0, "disp": False}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    slack = [0.0] * len(budgets)
    for _ in range(4):  # HiGHS accepts a row up to its feasibility tolerance over: tighten and re-solve
        rows = [LinearConstraint(one_each, rhs, rhs)]
        for table, budget, tight in zip(costs, budgets, slack):
            scale = max(abs(budget), 1e-30)
            row = [table[u][j] / scale for u, j in zip(var_unit, var_opt)] + [0.0] * len(alternatives)
            rows.append(LinearConstraint(np.array([row]), -np.inf, (budget - tight) / scale))
        res = milp(objective, constraints=rows, integrality=np.ones(n), bounds=Bounds(0, 1), options=options)
        if res.x is None:
            raise ValueError(f"knapsack: the integer program found no plan ({res.message})")
        if res.status != 0:
            raise ValueError(f"knapsack: the integer program stopped before proving its plan optimal "
                             f"({res.message}); raise time_limit or use solver='greedy'")
        choice = [-1] * len(keep)
        for k in np.flatnonzero(res.x[:len(var_unit)] > 0.5):
            choice[var_unit[k]] = var_opt[k]
        for whole, parts in alternatives:
            assert (choice[whole] >= 0) != all(choice[p] >= 0 for p in parts), "milp broke an alternative"
        assert sum(c >= 0 for c in choice) == len(keep) - sum(len(p) if choice[w] >= 0 else 1
                                                              for w, p in alternatives), "milp left a unit out"
        over = [total(table, choice) - budget for table, budget in zip(costs, budgets)]
        if all(o <= _tolerance(b) for o, b in zip(over, budgets)):
            return choice
        slack = [t + max(o, 0.0) for t, o in zip(slack, over)]
    raise ValueError("knapsack: the integer program's plans kept exceeding a budget by its feasibility tolerance")


def solve_greedy(losses: Table, costs: Sequence[Table], budgets: Sequence[float]) -> list[int]:
    """Greedy upgrades under one constraint (module doc)."""
    check_problem(losses, costs, budgets)
    if len(costs) != 1:
        raise ValueError("knapsack: the greedy solver handles one constraint; use solver='exact'")
    cost = costs[0]
    choice = [min(range(len(opts)), key=lambda j, opts=opts, u=u: (opts[j], losses[u][j])) for u, opts in enumerate(cost)]
    spare = budgets[0] - sum(cost[u][j] for u, j in enumerate(choice))
    while True:
        best = None  # (loss decrease per added cost, unit, option)
        for u, j0 in enumerate(choice):
            for j in range(len(cost[u])):
                extra = cost[u][j] - cost[u][j0]
                gain = losses[u][j0] - losses[u][j]
                if gain > 0 and extra <= spare + _tolerance(budgets[0]):
                    rate = gain / max(extra, 1e-30)
                    if best is None or rate > best[0]:
                        best = (rate, u, j)
        if best is None:
            return choice
        _, u, j = best
        spare -= cost[u][j] - cost[u][choice[u]]
        choice[u] = j


def solve(losses: Table, costs: Sequence[Table], budgets: Sequence[float], solver: str = "exact",
          alternatives: Sequence[tuple[int, Sequence[int]]] = ()) -> list[int]:
    if solver == "exact":
        return solve_exact(losses, costs, budgets, alternatives)
    if solver == "greedy":
        if not alternatives:
            return solve_greedy(losses, costs, budgets)
        # the greedy does not weigh a whole against its parts: it takes the parts (each at least as free)
        wholes = {w for w, _ in alternatives}
        keep = [i for i in range(len(losses)) if i not in wholes]
        picked = solve_greedy([losses[i] for i in keep], [[c[i] for i in keep] for c in costs], budgets)
        choice = [-1] * len(losses)
        for i, j in zip(keep, picked):
            choice[i] = j
        return choice
    raise ValueError(f"unknown solver {solver!r}; choose 'exact' or 'greedy'")


def total(table: Table, choice: Sequence[int]) -> float:
    """Σ of the chosen options' values (units left out, -1, count nothing)."""
    return sum(table[u][j] for u, j in enumerate(choice) if j >= 0)


def _tolerance(budget: float) -> float:
    return 1e-12 * abs(budget) + 1e-15
