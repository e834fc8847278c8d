"""Stage (c, links): effective bandwidth and latency of every pipeline link from matched send/recv.

The transfer of a matched pair starts when both sides have posted (the later start) and ends
when the receiver has the data. Links are compared with the median link: one much slower than
the rest (with at least three links to compare) is flagged. A host-timed link (CPU processes) must also
have delayed the critical path measurably, as a rank must to be named: there a healthy link's few
transfers can be slow by the scheduler alone, and then they delayed nobody.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from megascan.aggregate.merged_trace import MergedTrace
from megascan.detection.culprits import MIN_CAUSED_SHARE
from megascan.detection.delay_attribution import DelayAttribution
from megascan.detection.robust import median

# A link under this fraction of the median link's bandwidth is slow. A degraded link (PCIe instead of
# NVLink) is 10x off. GPU-timed transfers of healthy links agree within 2x; host-timed ones (CPU
# processes sharing an oversubscribed host: tests, --device cpu) carry the scheduler's latency, and
# healthy links of one DP2 x TP2 x PP2 run were measured 0.3x to 4.7x of the median over 8 transfers.
SLOW_LINK_FRACTION = {"cuda_event": 0.25, "host_clock": 0.1}
MIN_LINKS_TO_COMPARE = 3


def link_stats(merged: MergedTrace, attribution: DelayAttribution) -> list[dict]:
    """Per pipeline link (src -> dst) with a complete transfer: its transfers, bandwidth, median latency, the
    excess its transfers added to the critical paths, and whether it is slow against the other links."""
    per_link: defaultdict[tuple[int, int], dict[str, Any]] = defaultdict(
        lambda: {"bytes": 0, "seconds": 0.0, "latencies_us": [], "transfers": 0})
    for instance in merged.instances:
        if instance.kind != "p2p" or instance.missing:
            continue
        send, recv = instance.records.get(instance.src), instance.records.get(instance.dst)
        if not send or not recv or recv.end is None or recv.issued_only:
            continue
        duration = max(recv.end - max(send.start, recv.start), 1e-3)
        link = per_link[(instance.src, instance.dst)]
        link["bytes"] += instance.bytes or 0
        link["seconds"] += duration / 1e6
        link["latencies_us"].append(duration)
        link["transfers"] += 1
    links: list[dict[str, Any]] = []
    for (src, dst), link in sorted(per_link.items()):
        links.append({"src": src, "dst": dst, "transfers": link["transfers"],
                      "bandwidth_gbps": link["bytes"] / link["seconds"] / 1e9 if link["seconds"] else 0.0,
                      "median_latency_us": median(link["latencies_us"]), "slow": False,
                      "critical_path_delay_us": attribution.links.get((src, dst), 0.0)})
    if len(links) >= MIN_LINKS_TO_COMPARE:
        typical = median([link["bandwidth_gbps"] for link in links])
        for link in links:
            timer = merged.ranks[link["dst"]].timer  # the receiver's clock ends the transfer
            fraction = SLOW_LINK_FRACTION.get(timer, SLOW_LINK_FRACTION["cuda_event"])
            link["slow"] = link["bandwidth_gbps"] < fraction * typical and (
                timer != "host_clock" or link["critical_path_delay_us"] >= MIN_CAUSED_SHARE * attribution.path_us)
    return links
