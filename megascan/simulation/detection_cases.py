"""The detection case matrix: for a layout and a seed, simulated runs (megascan/simulation/simulated_traces.py) that are
healthy, have one or two slow GPUs in every role, a slow pipeline link, or a rank hung at one of
several operations, and the same in a host-bound job (every GPU waits for its host's launches): healthy,
a slow host (host-bound, not a slow GPU), a slow GPU; and the check that a report names exactly what was
injected. Used by
tests/test_detection_scenarios.py (small layouts) and bench/detection_scale.py (256-1024 ranks).
"""

import random

from megascan.detection.links import MIN_LINKS_TO_COMPARE
from megascan.simulation.simulated_traces import Scenario

SLOW_FACTORS = (1.2, 1.3, 1.45, 1.6)
SLOW_LINK_FACTOR = 6.0  # a link degraded to a sixth of its bandwidth (PCIe instead of NVLink is ~10x)
HOST_BOUND_COST = 1.3  # a host-bound job: hosts take 1.3x the GPU's time to issue its work
SLOW_HOST_FACTOR = 5.0  # a host five times slower: in a GPU-bound job (hosts at 0.3x) it issues at 1.5x the GPU
SLOW_GPU_IN_HOST_BOUND_JOB = 1.6  # slower than the hosts issue (1.3x): the job waits for it
SLOW_GPU_BEHIND_FULL_QUEUE = 1.3
FULL_LAUNCH_QUEUE_US = 3_000.0  # two layer halves of work issued ahead: the hosts block on every GPU, the slow one most
HANG_OPERATIONS = ("tp", "send", "recv", "grads", "embedding", "grad-norm", "start")


def _roles(layout, rng):
    """Role name -> a rank in that role: first, middle and last stage, a DP replica, a TP peer."""
    dp, tp, pp = layout.dp, layout.tp, layout.pp
    roles = {"first stage": layout.rank(0, 0, 0), "last stage": layout.rank(0, pp - 1, 0)}
    if pp > 2:
        roles["middle stage"] = layout.rank(0, rng.randrange(1, pp - 1), 0)
    if dp > 1:
        roles["DP replica"] = layout.rank(rng.randrange(1, dp), rng.randrange(pp), 0)
    if tp > 1:
        roles["TP peer"] = layout.rank(rng.randrange(dp), rng.randrange(pp), rng.randrange(1, tp))
    return roles


def _pairs(layout, roles, rng):
    """Two slow GPUs at once: in different stages, in different DP replicas, and two of one stage (never every
    rank of the job: with all ranks slow there is no healthy one to measure them against)."""
    pairs = {"first and last stage": (roles["first stage"], roles["last stage"])} if layout.world_size > 2 else {}
    if "middle stage" in roles and "TP peer" in roles and roles["TP peer"] != roles["middle stage"]:
        pairs["middle stage and a TP peer"] = (roles["middle stage"], roles["TP peer"])
    if "DP replica" in roles and layout.coords(roles["DP replica"])["pp"] != 0:
        pairs["two DP replicas"] = (roles["first stage"], roles["DP replica"])
    if layout.dp * layout.tp >= 3:  # two of a stage; with only two ranks the whole stage would be slow
        stage = rng.randrange(layout.pp)
        ranks = rng.sample([layout.rank(d, stage, t) for d in range(layout.dp) for t in range(layout.tp)], 2)
        pairs["two of one stage"] = tuple(ranks)
    return pairs


def _hang(layout, rng, which):
    """(rank, operation kind, occurrence) of a hang at ``which``, moved to where the layout has one."""
    rank = rng.randrange(layout.world_size)
    coords = layout.coords(rank)
    if which == "embedding":  # only the first and last stage hold the embedding
        rank = layout.rank(coords["dp"], 0, coords["tp"])
    missing = {"tp": layout.tp == 1, "grads": layout.dp == 1, "embedding": layout.pp == 1,
               "send": layout.pp == 1, "recv": layout.pp == 1, "grad-norm": layout.pp * layout.tp == 1}
    if missing.get(which):
        which = "start"
    return rank, which, rng.randrange(3) if which in ("tp", "send", "recv") else 0


def scenarios(dp, tp, pp, seed, microbatches=4, layers_per_stage=2, hangs=HANG_OPERATIONS):
    """(Scenario, expected) pairs for one layout and seed; expected: {"slow": set, "links": set, "hung": rank}."""
    base = {"dp": dp, "tp": tp, "pp": pp, "seed": seed, "microbatches": microbatches,
            "layers_per_stage": layers_per_stage}
    rng = random.Random(seed * 7919 + dp * 131 + tp * 17 + pp)
    layout = Scenario("layout", **base).layout
    cases = [(Scenario("healthy", **base), {})]
    roles = _roles(layout, rng)
    for number, (role, rank) in enumerate(roles.items()):
        factor = SLOW_FACTORS[(number + seed) % len(SLOW_FACTORS)]
        cases.append((Scenario(f"{role} {factor}x", culprits={rank: factor}, **base), {"slow": {rank}}))
    for number, (name, ranks) in enumerate(_pairs(layout, roles, rng).items()):
        factors = (SLOW_FACTORS[(number + seed) % 4], SLOW_FACTORS[(number + seed + 1) % 4])
        cases.append((Scenario(f"{name} {factors[0]}x {factors[1]}x", culprits=dict(zip(ranks, factors)), **base),
                      {"slow": set(ranks)}))
    if dp * tp * (pp - 1) * 2 >= MIN_LINKS_TO_COMPARE:  # a slow link shows against at least two others
        d, t, stage = rng.randrange(dp), rng.randrange(tp), rng.randrange(pp - 1)
        link = (layout.rank(d, stage, t), layout.rank(d, stage + 1, t))
        if rng.random() < 0.5:
            link = link[::-1]
        cases.append((Scenario(f"slow link {link[0]}->{link[1]}", slow_links={link: SLOW_LINK_FACTOR}, **base),
                      {"links": {link}}))
    cases += _host_bound_cases(layout, roles, base)
    for number, which in enumerate(hangs):
        rank, kind, occurrence = _hang(layout, rng, which)
        iteration = 9 + number % 2  # the first or second iteration of the last window
        cases.append((Scenario(f"hang at {kind} #{occurrence}", hang=(rank, iteration, kind, occurrence),
                               hung_writes_issued=number % 3 != 2, **base), {"hung": rank}))
    return cases


def _host_bound_cases(layout, roles, base):
    """A host-bound job, healthy and with a slow GPU; a slow host in a GPU-bound job, where it sets the pace:
    the first stage (the others wait in pipeline bubbles, where a late host catches up)."""
    first, peer = roles["first stage"], roles.get("TP peer", roles.get("DP replica"))
    cases = [(Scenario("host-bound job", host_cost=HOST_BOUND_COST, **base), {}),
             (Scenario(f"slow host, first stage {SLOW_HOST_FACTOR}x", host_slow={first: SLOW_HOST_FACTOR}, **base),
              {"host_bound": {first}})]
    if peer is not None and layout.coords(peer)["pp"] == 0:
        cases.append((Scenario(f"slow host, {peer} {SLOW_HOST_FACTOR}x", host_slow={peer: SLOW_HOST_FACTOR}, **base),
                      {"host_bound": {peer}}))
    cases.append((Scenario(f"host-bound job, slow GPU {SLOW_GPU_IN_HOST_BOUND_JOB}x", host_cost=HOST_BOUND_COST,
                           culprits={roles["last stage"]: SLOW_GPU_IN_HOST_BOUND_JOB}, **base),
                  {"slow": {roles["last stage"]}}))
    # A fast host blocked on its slow GPU's full launch queue: back-pressure, the GPU's fault.
    slowed = peer if peer is not None else first
    cases.append((Scenario(f"slow GPU {SLOW_GPU_BEHIND_FULL_QUEUE}x behind a full launch queue",
                           launch_queue_us=FULL_LAUNCH_QUEUE_US, culprits={slowed: SLOW_GPU_BEHIND_FULL_QUEUE},
                           **base), {"slow": {slowed}}))
    return cases


def check(report, run, expected):
    """What the report got wrong against the injected faults: [] when every culprit is named first and
    nothing else is named (no other suspect, no other slow link, every blocked rank listed as blocked)."""
    problems = []
    named = [(suspect.rank, suspect.kind) for suspect in report.suspects]
    wanted = sorted((rank, "slow_rank") for rank in expected.get("slow", ()))
    if "hung" in expected:
        wanted = [(expected["hung"], "hang")]
    if sorted(named) != sorted(wanted):
        problems.append(f"suspects {named}, expected {wanted}")
    host_bound = {entry.rank for entry in report.host_bound}
    if host_bound != expected.get("host_bound", set()):
        problems.append(f"host-bound {sorted(host_bound)}, expected {sorted(expected.get('host_bound', ()))}")
    slow_links = {(link["src"], link["dst"]) for link in report.links if link["slow"]}
    if slow_links != expected.get("links", set()):
        problems.append(f"slow links {sorted(slow_links)}, expected {sorted(expected.get('links', ()))}")
    blocked = {entry["rank"] for entry in report.blocked}
    if blocked != run.blocked:
        problems.append(f"blocked {sorted(blocked)}, expected {sorted(run.blocked)}")
    return problems
