"""Run the spelling properties over every spelling and count what the fuser does with each.

    .venv/bin/python scripts/spelling_long_run.py [--examples N] [--mutants N] [--seed S]

Draws equivalent layers and mutants from every spelling (``tests/spellings/strategies.py``,
``all_cases`` / ``all_mutants``, hypothesis profile ``spellings-long``), runs each through
``onnx_moe_fuse.fuse`` and the checks of ``tests/spellings/outcomes.py``, and prints:

* a sweep: one axis of fused, supported base layers changed to each spelling in turn (every
  routing with the k and groups it needs), and each mutation applied to those bases (split by
  routing family: routed by the fused ops themselves, or through the routing construction);
* per spelling (axis = value), over the cases whose *other* axes are all in ``SUPPORTED``
  (so a spelling is measured alone): fused / refused / wrong-op / wrong-numbers / error counts,
  and whether ``SUPPORTED`` lists it;
* per outcome, the distinct reasons and how often each came, with one example case;
* per mutation: refused-and-named / unnamed / fused / modified / error counts.

It never fails on a wrong outcome: it is the measurement from which ``SUPPORTED`` grows.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

from hypothesis import given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.spellings import strategies as S  # noqa: E402
from tests.spellings.outcomes import check_equivalent, check_mutant  # noqa: E402

SWEEP_AXES = {
    "router": S.ROUTERS,
    "routing": S.ROUTINGS,
    "experts": S.EXPERTS,
    "activation": S.ACTIVATIONS,
    "combine": S.COMBINES,
    "weight_dtype": S.WEIGHT_DTYPES,
    "granularity": S.GRANULARITIES,
    "zero_point": S.ZERO_POINTS,
    "rank": S.RANKS,
    "shapes": S.SHAPES,
    "bias": S.BIASES,
}


def _with(base: S.LayerCase, axis: str, value: object) -> S.LayerCase:
    """``base`` with one axis (a LayerCase field of that name) set to ``value``.

    A routing comes with the k and groups it needs (``strategies.with_routing``: k = 1 for a
    top-1, groups for a grouped top-k); a rank with token sizes of that rank.
    """
    if axis == "routing":
        return S.with_routing(base, str(value))
    changes: dict[str, object] = {axis: value}
    if axis == "experts" and value == "top1_squeezed":  # one slot, its Mul combine
        changes.update(top_k=1, combine="mul_reducesum")
        if base.routing == "grouped_topk":
            changes.update(routing="softmax_topk_div", groups=1, topk_group=1)
    if axis == "combine" and value in ("scatter_elements", "scatter_nd"):
        changes["experts"] = "rows_gathernd"  # the scatters sum flat rows
    if axis == "bias" and value != "none" and base.experts not in S.BIAS_EXPERTS:
        changes["experts"] = "gather_expand"
    if axis == "rank" and value != base.rank:
        changes["token_dims"] = (5,) if value == 2 else (2, 3)
    return dataclasses.replace(base, **changes)


def _others_supported(case: S.LayerCase, axis: str) -> bool:
    """Every axis but ``axis`` supported, and no listed unsupported combination."""
    if any(pred(case) for _, pred, _ in S.UNSUPPORTED_COMBINATIONS):
        return False
    return all(v is None or v in S.SUPPORTED[a] for a, v in case.axis_values().items() if a != axis)


def _collect(strategy, check, count: int, run_seed: int | None) -> list[tuple[S.LayerCase, object]]:
    results: list[tuple[S.LayerCase, object]] = []
    if count <= 0:  # hypothesis takes no max_examples=0: nothing drawn
        return results

    @settings(settings.get_profile("spellings-long"), max_examples=count)
    @given(strategy)
    def run(case: S.LayerCase) -> None:
        results.append((case, check(case)))

    if run_seed is not None:
        run = seed(run_seed)(run)
    run()
    return results


LAYER_KINDS = ("fused", "refused", "wrong-op", "wrong-numbers", "error")
MUTANT_KINDS = ("refused", "unnamed", "fused", "modified", "error")


def _row(first: str, cells: list[object]) -> str:
    """One table row: a 44-wide first column, then 9-wide right-aligned cells."""
    return f"{first:44}" + "".join(f"{str(c):>9}" for c in cells)


def _sweep(bases: list[S.LayerCase], per_value: int) -> None:
    """Change one axis of supported, fused base layers to each spelling in turn: fuses or not."""
    print(f"\n## sweep: one axis changed on up to {per_value} supported base layers each\n")
    print(_row("axis = spelling", ["SUPPORTED", "n", *LAYER_KINDS]))
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for axis, values in SWEEP_AXES.items():
        for value in values:
            cases = [_with(b, axis, value) for b in bases]
            cases = [
                c
                for c in cases
                if S.is_valid(c)
                and c.axis_values()[axis] is not None  # granularity of a float layer: no change
                and _others_supported(c, axis)
            ]
            counts = collections.Counter()
            for case in cases[:per_value]:
                outcome = check_equivalent(case)
                counts[outcome.kind] += 1
                if outcome.kind != "fused":
                    reasons[f"{axis} = {value}"][str(outcome)] += 1
            mark = "yes" if value in S.SUPPORTED[axis] else "no"
            cells = [mark, sum(counts.values()), *(counts[k] for k in LAYER_KINDS)]
            print(_row(f"{axis} = {value}", cells))
    print("\n## sweep: why the changed layers did not fuse\n")
    for label, texts in reasons.items():
        for text, n in texts.most_common():
            print(f"{label:36} {n:3}  {text}")


def _mutation_sweep(bases: list[S.LayerCase], per_value: int) -> None:
    """Break fused base layers by each mutation in turn (``strategies.mutant_of``)."""
    print(f"\n## sweep: each mutation on up to {per_value} fused base layers per routing family\n")
    print(_row("mutation (routing family)", ["SUPPORTED", "n", *MUTANT_KINDS]))
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for mutation in S.MUTATIONS:
        for constructed in (False, True):
            family = "constructed" if constructed else "direct"
            cases = [S.mutant_of(b, mutation) for b in bases if b.constructed == constructed]
            cases = [c for c in cases if c is not None][:per_value]
            if not cases:
                continue
            counts = collections.Counter()
            for case in cases:
                outcome = check_mutant(case)
                counts[outcome.kind] += 1
                if outcome.kind != "refused":
                    reasons[f"{mutation} ({family})"][str(outcome)] += 1
            mark = "yes" if mutation in S.SUPPORTED["mutation"] else "no"
            cells = [mark, sum(counts.values()), *(counts[k] for k in MUTANT_KINDS)]
            print(_row(f"{mutation} ({family})", cells))
    print("\n## sweep: why the broken layers were not refused and named\n")
    for label, texts in reasons.items():
        for text, n in texts.most_common():
            print(f"{label:36} {n:3}  {text}")


def _spelling_table(results, title: str) -> None:
    print(f"\n## {title}: per spelling (other axes supported, no unsupported combination)\n")
    print(_row("axis = spelling", ["SUPPORTED", "n", *LAYER_KINDS]))
    for axis in S.SUPPORTED:
        if axis == "mutation":
            continue
        counts: dict[object, collections.Counter] = collections.defaultdict(collections.Counter)
        for case, outcome in results:
            value = case.axis_values()[axis]
            if value is None or not _others_supported(case, axis):
                continue
            counts[value][outcome.kind] += 1
        for value in sorted(counts, key=str):
            c = counts[value]
            mark = "yes" if value in S.SUPPORTED[axis] else "no"
            cells = [mark, sum(c.values()), *(c[k] for k in LAYER_KINDS)]
            print(_row(f"{axis} = {value}", cells))


def _reasons(results, title: str, skip: str) -> None:
    print(f"\n## {title}: outcomes other than '{skip}', by reason\n")
    seen: dict[str, list] = collections.defaultdict(list)
    for case, outcome in results:
        if outcome.kind != skip:
            seen[str(outcome)].append(case)
    for text, cases in sorted(seen.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(cases):5}  {text}\n       e.g. {cases[0].label()}")


def main(argv: list[str] | None = None) -> int:
    """Run the long measurement and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1500, help="equivalent layers to draw")
    parser.add_argument("--mutants", type=int, default=600, help="mutants to draw")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default random)")
    parser.add_argument("--sweep", type=int, default=8, help="base layers per swept spelling")
    args = parser.parse_args(argv)
    start = time.time()
    layers = _collect(S.all_cases(), check_equivalent, args.examples, args.seed)
    mutants = _collect(S.all_mutants(), check_mutant, args.mutants, args.seed)
    print(f"# {len(layers)} equivalent layers, {len(mutants)} mutants, {time.time() - start:.0f} s")
    total = collections.Counter(o.kind for _, o in layers)
    print("equivalent layers:", dict(total))
    combos = collections.Counter(
        name for case, _ in layers for name, pred, _ in S.UNSUPPORTED_COMBINATIONS if pred(case)
    )
    supported = [(c, o) for c, o in layers if S.is_supported(c)]
    fused = sum(o.kind == "fused" for _, o in supported)
    print(f"all-supported layers: {len(supported)}, fused {fused}")
    print(f"cases in listed unsupported combinations: {dict(combos)}")
    bases = [c for c, o in layers if S.is_supported(c) and o.kind == "fused"]
    _sweep(bases, args.sweep)
    _mutation_sweep(bases, args.sweep)
    _spelling_table(layers, "equivalent layers")
    print("\n## listed unsupported combinations (UNSUPPORTED_COMBINATIONS)\n")
    for name, pred, why in S.UNSUPPORTED_COMBINATIONS:
        c = collections.Counter(o.kind for case, o in layers if pred(case))
        print(f"{name:32} n {sum(c.values()):4}  {dict(c)}  ({why})")
    _reasons(layers, "equivalent layers", "fused")
    print("\n## mutants: per mutation, on supported bases (last two columns: on all bases)\n")
    print(_row("mutation", ["SUPPORTED", "n", *MUTANT_KINDS, "n (all)", "refused"]))
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_all: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    base_ok = [(c, o) for c, o in mutants if _others_supported(c, "mutation")]
    for case, outcome in mutants:
        per_all[case.mutation][outcome.kind] += 1
    for case, outcome in base_ok:
        per[case.mutation][outcome.kind] += 1
    for m in S.MUTATIONS:
        c, a = per[m], per_all[m]
        mark = "yes" if m in S.SUPPORTED["mutation"] else "no"
        cells = [mark, sum(c.values()), *(c[k] for k in MUTANT_KINDS)]
        print(_row(m, [*cells, sum(a.values()), a["refused"]]))
    _reasons(base_ok, "mutants on supported bases", "refused")
    others = [(c, o) for c, o in mutants if not _others_supported(c, "mutation")]
    _reasons(others, "mutants on the other bases", "refused")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
