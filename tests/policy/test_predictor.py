"""`fair`'s fast paths give exactly what the plain definitions give (they keep decisions fast).

The predictor keeps chunks and kappas from one decision to the next (until what each depends on
is learned); its ``Neighbourhood`` caches per search (duties, solutions without a change), solves
a set of apps that share no GPU in one round, keeps a chunk that no other app of the set shares
out of the fixed point's rounds (its value cannot change), adds outside terms only on GPUs with
an app outside the set, and the search keeps Eq. 2's terms, user counts per GPU and compared
changes. Each is checked here against a straightforward
reference on random configurations, bit for bit (floats compared with ==): the speed-ups must
not change a single decision.
"""

from __future__ import annotations

import contextlib
import copy
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from drbalance.policy import AppView, PolicyConfig, Snapshot
from drbalance.policy.fair import FairPolicy, _gained, _Search
from drbalance.policy.predictor import Neighbourhood, Predictor
from drbalance.ratio import DataRatio
from tests.helpers.slowdown import predicted_slowdown

ITERATIONS = 1000


def view(name, shares, chunk, extra, iteration, batch, measured=True):
    """An app of 1000 planned iterations whose chunks took ``chunk`` s per full batch (and less
    for smaller chunks); unmeasured apps have no chunk times yet."""
    ratio = DataRatio(shares)
    sizes = ratio.split(batch)
    iteration_time = 0.05 + chunk + extra
    sd = (iteration * iteration_time + (ITERATIONS - iteration) * iteration_time) / (ITERATIONS * 0.15)
    if not measured:
        return AppView(name, ratio, sd, iteration=iteration, iterations_total=ITERATIONS,
                       iteration_time=iteration_time, solo_time=ITERATIONS * 0.15, batch=batch)
    return AppView(name, ratio, sd, iteration=iteration, iterations_total=ITERATIONS, iteration_time=iteration_time,
                   solo_time=ITERATIONS * 0.15, batch=batch,
                   chunk_seconds=tuple(chunk * (0.3 + 0.7 * n / batch) if n else None for n in sizes),
                   chunk_samples=tuple(float(n) for n in sizes))


@st.composite
def configurations(draw):
    """Apps on 2-4 GPUs with learned interference (two observed windows), and a change of one or
    two apps' DRs."""
    gpus = draw(st.integers(2, 4))
    shares = st.lists(st.integers(0, 10), min_size=gpus, max_size=gpus).filter(lambda s: sum(s) > 0)
    count = draw(st.integers(1, 6))
    views = []
    for index in range(count):
        ratio = DataRatio.from_weights(draw(shares))
        views.append(view(f"x{index}", ratio.shares, draw(st.floats(0.02, 0.5)), draw(st.floats(0.0, 0.3)),
                          draw(st.integers(10, 900)), draw(st.sampled_from([4, 32, 128])),
                          measured=draw(st.booleans()) or index == 0))
    predictor = Predictor(gpus)
    predictor.observe(views)
    later = [copy.copy(v) for v in views]
    for index, old in enumerate(views):
        if old.chunk_seconds is not None:
            factor = draw(st.floats(1.0, 2.0))
            stretched = tuple(s * factor if s is not None else None for s in old.chunk_seconds)
            later[index] = AppView(old.name, old.ratio, old.slowdown, iteration=old.iteration + 20,
                                   iterations_total=old.iterations_total, iteration_time=old.iteration_time * factor,
                                   solo_time=old.solo_time, batch=old.batch, chunk_seconds=stretched,
                                   chunk_samples=old.chunk_samples)
    predictor.observe(later)
    moved = draw(st.lists(st.sampled_from([v.name for v in later]), min_size=1, max_size=2, unique=True))
    changes = {name: DataRatio.from_weights(draw(shares)) for name in moved}
    return predictor, later, changes


def plain_pair_kappa(predictor, app, other, crowd):
    """``Predictor.pair_kappa`` written plainly (before the predictor kept kappas): looked up afresh
    in the learned kappas and the running sums."""
    pair, learned, sums = (app, other), predictor.kappa, predictor._sums
    found = learned[False].get(pair)
    if crowd:
        if found is None:
            found = learned[True].get(pair)
        if found is None:
            found = sums[False].estimate(app, other)
    elif found is None:
        found = sums[False].estimate(app, other)
        if found is None:
            found = learned[True].get(pair)
    if found is None:
        found = sums[True].estimate(app, other)
    return predictor.config.interference_prior if found is None else found


def reference_solve(predictor, ratios, views, names, changes):
    """The fixed point written plainly, without the speed-ups (with the pair and crowd kappas):
    every duty and kappa looked up afresh, three Gauss-Seidel rounds over dicts."""
    config, apps, speed = predictor.config, predictor.apps, predictor.speed
    ratios = {name: ratio for name, ratio in ratios.items() if name in apps}

    def gpus_of(name, ratio):
        return [gpu for gpu, size in enumerate(ratio.split(apps[name].batch)) if size]

    on_gpu = [[] for _ in range(predictor.gpu_count)]
    duty = {}
    for name, ratio in ratios.items():
        record = views.get(name)
        seconds = record.chunk_seconds if record is not None else None
        for gpu in gpus_of(name, ratio):
            on_gpu[gpu].append(name)
            value = seconds[gpu] if seconds is not None and record.iteration_time else None
            duty[(name, gpu)] = min(1.0, value / record.iteration_time) if value else config.duty_prior
    inside = set(names)
    chunks, fixed, occupants = {}, {}, {}
    for name in names:
        model = apps[name]
        sizes = (changes.get(name) or ratios[name]).split(model.batch)
        work = model.work(config)
        chunks[name] = [(g, work * predictor.size_factor(n, model.batch) / speed[g]) for g, n in enumerate(sizes) if n]
        fixed[name] = model.host_time(config) + model.overhead_time(config) * (len(chunks[name]) - 1)
    for name in names:
        for gpu, _ in chunks[name]:
            if gpu not in occupants:
                occupants[gpu] = [other for other in on_gpu[gpu] if other not in inside]
            occupants[gpu].append(name)
    plans = []
    for name in names:
        for gpu, chunk in chunks[name]:
            outside, partners = 1.0, []
            crowd = len(occupants[gpu]) > 2  # the app and two others or more
            for other in occupants[gpu]:
                if other == name:
                    continue
                if other in inside:
                    partners.append((plain_pair_kappa(predictor, name, other, crowd), (other, gpu), other))
                else:
                    outside += plain_pair_kappa(predictor, name, other, crowd) * duty[(other, gpu)]
            plans.append((name, gpu, chunk, outside, partners))
    stretched = {(name, gpu): chunk for name, gpu, chunk, _, _ in plans}
    times = {name: fixed[name] + max((c for _, c in chunks[name]), default=0.0) for name in names}
    for _ in range(3):
        longest = dict.fromkeys(names, 0.0)
        for name, gpu, chunk, outside, partners in plans:
            stretch = outside
            for factor, key, other in partners:
                stretch += factor * min(1.0, stretched[key] / times[other])
            stretched[(name, gpu)] = chunk * stretch
            longest[name] = max(longest[name], chunk * stretch)
        for name in names:
            times[name] = fixed[name] + longest[name]
    affected = set(changes)
    for name, ratio in changes.items():
        for gpu in gpus_of(name, ratio) + (gpus_of(name, ratios[name]) if name in ratios else []):
            affected.update(on_gpu[gpu])
    return {name: times[name] * apps[name].correction for name in names}, sorted(affected)


@settings(max_examples=150)
@given(configurations())
def test_the_neighbourhood_solves_exactly_as_the_plain_fixed_point(case):
    check_against_the_plain_fixed_point(*case)


@settings(max_examples=150)
@given(configurations())
def test_the_dense_solve_of_a_crowd_is_the_plain_fixed_point_to_the_last_bit(case):
    """Every set through ``Neighbourhood._solve_dense`` (numpy, used for crowds): the same floats."""
    with dense_from(0):
        check_against_the_plain_fixed_point(*case)


@contextlib.contextmanager
def dense_from(partners):
    kept = Neighbourhood.DENSE_PARTNERS
    Neighbourhood.DENSE_PARTNERS = partners
    try:
        yield
    finally:
        Neighbourhood.DENSE_PARTNERS = kept


def check_against_the_plain_fixed_point(predictor, views, changes):
    ratios = {v.name: v.ratio for v in views}
    lookup = {v.name: v for v in views}
    neighbourhood = predictor.neighbourhood(ratios, lookup)
    _, names = reference_solve(predictor, ratios, lookup, [], changes)
    assert neighbourhood.affected(changes) == names
    expected = (reference_solve(predictor, ratios, lookup, names, {})[0],
                reference_solve(predictor, ratios, lookup, names, changes)[0])
    for _ in range(2):  # the second time from the neighbourhood's caches
        assert neighbourhood.compare(changes) == expected
    everyone = list(ratios)
    assert predictor.iteration_times(ratios, lookup) == reference_solve(predictor, ratios, lookup, everyone, {})[0]
    alone = [name for name in everyone if name not in names][:1] or everyone[:1]
    assert neighbourhood.solve(alone, {}) == reference_solve(predictor, ratios, lookup, alone, {})[0]


@settings(max_examples=100)
@given(configurations(), st.sets(st.integers(0, 3), max_size=2), st.data())
def test_the_searchs_shortcuts_agree_with_their_definitions(case, locked, data):
    predictor, views, changes = case
    gpus = predictor.gpu_count
    policy = FairPolicy()
    policy.predictor = predictor
    snapshot = Snapshot(tuple(views), (50.0,) * gpus, PolicyConfig(gpus))
    locked = {gpu for gpu in locked if gpu < gpus}
    search = _Search(policy, snapshot, predictor, views[0], locked)
    times = {v.name: data.draw(st.floats(0.05, 2.0)) for v in views}
    expected = {v.name: predicted_slowdown(v, times[v.name]) for v in views}
    assert search.sds(times) == {name: sd for name, sd in expected.items() if sd is not None}
    # an idle GPU taken: the GPUs in use, before and after, as sets
    before = {gpu for ratio in search.ratios.values() for gpu in ratio.used}
    after = {gpu for ratio in {**search.ratios, **changes}.values() for gpu in ratio.used}
    assert search._fills_idle_gpu(changes) == (len(after) > len(before))
    for name, ratio in changes.items():
        current = search.ratios[name]
        assert search._touches_lock(current, ratio) == any(g in locked for g in _gained(current, ratio))
    assert search.compare(changes) == search.neighbourhood.compare(changes) == search.compare(changes)


@settings(max_examples=60)
@given(configurations(), st.data())
def test_forgetting_gone_apps_keeps_the_running_sums_exactly(case, data):
    predictor, views, _ = case
    live = data.draw(st.sets(st.sampled_from([v.name for v in views])))
    plain = copy.deepcopy(predictor)
    for name in [name for name in plain.apps if name not in live]:
        del plain.apps[name]
    for crowd, learned in plain.kappa.items():
        for pair in [pair for pair in learned if pair[0] not in live or pair[1] not in live]:
            plain._set_kappa(pair, crowd, None)
    predictor.forget(live)
    assert predictor.kappa == plain.kappa
    for crowd in (False, True):
        mine, theirs = predictor._sums[crowd], plain._sums[crowd]
        assert (mine.total, mine.count) == (theirs.total, theirs.count)
        assert mine.suffered == theirs.suffered and mine.caused == theirs.caused
    assert set(predictor.apps) == set(plain.apps)


@settings(max_examples=60)
@given(configurations(), st.floats(1.0, 3.0))
def test_a_neighbourhood_kept_while_the_predictor_learns_predicts_from_what_it_learned(case, factor):
    predictor, views, changes = case
    ratios = {v.name: v.ratio for v in views}
    lookup = {v.name: v for v in views}
    neighbourhood = predictor.neighbourhood(ratios, lookup)
    names = neighbourhood.affected(changes)
    neighbourhood.compare(changes)  # fills the caches: kappas of both contexts, chunks, solutions
    generation = predictor.generation
    # a new window in which every measured app ran slower: kappas, host times, corrections move
    later = [AppView(v.name, v.ratio, v.slowdown, iteration=v.iteration + 20, iterations_total=v.iterations_total,
                     iteration_time=v.iteration_time * factor, solo_time=v.solo_time, batch=v.batch,
                     chunk_seconds=tuple(s * factor if s is not None else None for s in v.chunk_seconds),
                     chunk_samples=v.chunk_samples) if v.chunk_seconds is not None else v for v in views]
    predictor.observe(later)
    assert predictor.generation > generation
    expected = (reference_solve(predictor, ratios, lookup, names, {})[0],
                reference_solve(predictor, ratios, lookup, names, changes)[0])
    assert neighbourhood.compare(changes) == expected
    for name in names:
        for other in ratios:
            for crowd in (False, True):
                assert neighbourhood.kappa(name, other, crowd) == predictor.pair_kappa(name, other, crowd)


@settings(max_examples=60)
@given(configurations(), st.floats(1.0, 3.0), st.data())
def test_the_predictors_kept_kappas_and_chunks_follow_what_it_learns(case, factor, data):
    """Kept from one decision to the next (``Predictor.pair_kappa``, ``Predictor.chunks``), each
    kappa and chunk equals the plain definition after more learning, a move and forgotten apps."""
    predictor, views, changes = case
    names = [v.name for v in views]

    def check():
        for name in predictor.apps:
            for other in names:
                for crowd in (False, True):
                    assert predictor.pair_kappa(name, other, crowd) == plain_pair_kappa(predictor, name, other, crowd)
            for ratio in [v.ratio for v in views] + list(changes.values()):
                kept = predictor.chunks(name, ratio)
                assert kept == predictor._chunks_of(predictor.apps[name], ratio)
                model = predictor.apps[name]
                plain = [(g, model.work(predictor.config) * predictor.size_factor(n, model.batch) / predictor.speed[g])
                         for g, n in enumerate(ratio.split(model.batch)) if n]
                if len(plain) > 1:
                    plain = [(g, seconds * predictor.replica_factor(len(plain))) for g, seconds in plain]
                assert list(kept.placed) == plain

    check()  # every kappa and chunk now kept
    later = [AppView(v.name, v.ratio, v.slowdown, iteration=v.iteration + 20, iterations_total=v.iterations_total,
                     iteration_time=v.iteration_time * factor, solo_time=v.solo_time, batch=v.batch,
                     chunk_seconds=tuple(s * factor if s is not None else None for s in v.chunk_seconds),
                     chunk_samples=v.chunk_samples) if v.chunk_seconds is not None else v for v in views]
    predictor.observe(later, learn_from=data.draw(st.sets(st.sampled_from(names))))
    check()
    predictor.learn_move(1, 2, data.draw(st.floats(0.5, 2.0)), 1.0)  # the replica penalty moves
    check()
    predictor.forget(data.draw(st.sets(st.sampled_from(names))))
    names = list(predictor.apps)
    check()


class Shares(list):
    """A sequence that is not a plain list: DataRatio checks it the long way."""


@given(st.lists(st.one_of(st.integers(-2, 12), st.booleans(), st.floats(0, 10)), max_size=5),
       st.one_of(st.none(), st.integers(-1, 20)))
def test_the_data_ratios_fast_path_accepts_and_refuses_as_the_full_checks(shares, total):
    def build(value):
        try:
            return DataRatio(value, total)
        except ValueError as error:
            return str(error)

    fast, full = build(list(shares)), build(Shares(shares))
    assert fast == full
    if isinstance(fast, DataRatio):
        assert fast.used == tuple(i for i, share in enumerate(fast.shares) if share > 0)


def test_an_idle_gpu_taken_or_left_idle_by_hand():
    # GPUs 0 and 1 carry two apps each, GPU 2 nobody: moving one app there takes it
    views = (view("a", [5, 5, 0], 0.1, 0.0, 100, 32), view("b", [5, 5, 0], 0.1, 0.0, 100, 32))
    policy = FairPolicy()
    snapshot = Snapshot(views, (50.0,) * 3, PolicyConfig(3))
    policy.decide("a", "boundary", snapshot)
    search = _Search(policy, snapshot, policy.predictor, views[0], set())
    assert search._fills_idle_gpu({"a": DataRatio([0, 0, 10])})
    assert search._fills_idle_gpu({"a": DataRatio([0, 5, 5])})
    assert not search._fills_idle_gpu({"a": DataRatio([10, 0, 0])})
    assert not search._fills_idle_gpu({"a": DataRatio([0, 0, 10]), "b": DataRatio([0, 10, 0])})  # GPU 0 emptied


def test_a_crowd_of_spread_apps_is_solved_alike_by_both_paths():
    """16 apps over GPUs 0-3 (the crowded start), two over GPUs 3-4 (GPU 4: a pair), two over 3 and
    5, and four over 5-7 that a change of a crowd's app reaches only through them (outside the
    set, counting by their duty); every change's comparison, dense and in Python, equal."""
    rng = random.Random(7)
    gpus = 8
    spans = [range(0, 4)] * 16 + [range(3, 5)] * 2 + [(3, 5)] * 2 + [range(5, 8)] * 4
    views = [view(f"x{index}", DataRatio.from_weights([int(g in span) for g in range(gpus)]).shares,
                  rng.uniform(0.02, 0.5), rng.uniform(0.0, 0.3), rng.randint(10, 900), rng.choice([32, 128]),
                  measured=index % 5 != 3)
             for index, span in enumerate(spans)]
    predictor = Predictor(gpus)
    predictor.observe(views)
    ratios = {v.name: v.ratio for v in views}
    lookup = {v.name: v for v in views}
    crowd = views[:16]
    changes = [{v.name: DataRatio.from_weights([rng.randint(0, 4) + (g == 0) if g < 4 else 0 for g in range(gpus)])}
               for v in rng.sample(crowd, 10)]
    first, second = DataRatio.from_weights([1] + [0] * (gpus - 1)), DataRatio.from_weights([0, 1] + [0] * (gpus - 2))
    changes += [{a.name: first, b.name: second} for a, b in zip(crowd[::2], crowd[1::2])]
    with dense_from(10**9):
        plain = predictor.neighbourhood(ratios, lookup)
        expected = [plain.compare(change) for change in changes]
    with dense_from(0):
        dense = predictor.neighbourhood(ratios, lookup)
        found = [dense.compare(change) for change in changes]
        assert dense._terms, "no app outside a set: the test would not reach outside terms"
    assert found == expected


def test_the_crowd_benchmark_decides_alike_on_both_paths():
    """``bench_policy --crowd`` at a size where the dense solve is taken: same decisions."""
    from benchmarks.bench_policy import crowd, crowd_snapshot

    apps, gpus = 24, 8
    assert gpus * apps * (apps - 1) >= Neighbourhood.DENSE_PARTNERS  # all spread: every set is a crowd
    assert all(v.ratio.used == tuple(range(gpus)) for v in crowd_snapshot(apps, gpus, 0).apps)
    case = crowd(apps, gpus, repeats=2, steps=2)
    assert case["differences"] == 0
    assert len(case["branches"]) == 2 and all(len(values) == 2 for values in case["seconds"].values())
