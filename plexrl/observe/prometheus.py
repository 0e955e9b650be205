"""`cluster.metrics()` in the Prometheus text format, through prometheus-client.

Names follow Prometheus' conventions: a `plexrl_` prefix, base units in the name (`_seconds`,
`_bytes`), `_total` on counters, labels for dimensions with few values (`node`, `device`, `job`,
`kind`, `tier`). Every figure is read from one `metrics()` call per scrape, so a scrape sees one
consistent snapshot; counters are the runtime's own running sums (they never go down while the
cluster lives). Histograms (queueing delay, request latency, switch time) are the event log's
(runtime/activity.py). A job label is a job name (in `plexrl serve`, a session id): only an
operator may scrape (plexrl/observe/web.py), and no secret is ever a label.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from plexrl.runtime.activity import BUCKETS_S

# metrics() key -> (metric name without plexrl_ and _total, help): cluster-wide counters
COUNTERS = {
    "switches": ("switches", "loads of a state onto a device"),
    "transition_bytes": ("transition_bytes", "bytes moved by state transitions"),
    "transition_s": ("transition_seconds", "seconds spent in state transitions"),
    "writebacks": ("writebacks", "write-through copies of a changed state to its host copy"),
    "writeback_bytes": ("writeback_bytes", "bytes the write-throughs copied"),
    "writeback_zeroed_bytes": ("writeback_zeroed_bytes", "gradient bytes zeroed in place on the host"),
    "writeback_s": ("writeback_seconds", "seconds spent writing back"),
    "prefetches": ("prefetches", "loads made while the device ran another function"),
    "prefetch_bytes": ("prefetch_bytes", "bytes the prefetches moved"),
    "prefetch_s": ("prefetch_seconds", "copy time of the prefetches"),
    "prefetch_exposed_s": ("prefetch_exposed_seconds", "prefetch time the running function did not hide"),
    "migrations": ("migrations", "jobs moved between node groups"),
}
# jobs[JOB] key -> (name, help): per-job counters
JOB_COUNTERS = {
    "consumed_device_s": ("job_consumed_device_seconds", "device time a job is billed: execution plus switch-ins"),
    "exec_s": ("job_exec_seconds", "device time of a job's functions"),
    "exec_wall_s": ("job_exec_wall_seconds", "wall time of a job's functions on their devices"),
    "switch_s": ("job_switch_seconds", "transition time charged to a job"),
    "queue_wait_s": ("job_queue_wait_seconds", "time a job's requests waited in a group queue"),
    "requests": ("job_requests", "requests of a job dispatched"),
    "failed": ("job_failed_requests", "requests of a job that failed"),
}
RECOVERY = {
    "worker_restarts": ("worker_restarts", "device processes restarted after they died"),
    "restored_states": ("restored_states", "states that fell back to their host copies after a restart"),
    "lost_work_s": ("lost_work_seconds", "work lost to faults"),
    "node_losses": ("node_losses", "nodes lost"),
    "restored_from_checkpoint": ("restored_from_checkpoint", "models restored from a checkpoint after a node loss"),
    "restored_from_base": ("restored_from_base", "models restored from their base folder after a node loss"),
}
HISTOGRAMS = {
    "queueing_delay_s": ("queueing_delay_seconds", "a request's wait in its group queue, arrival to dispatch",
                         ("node", "job")),
    "request_latency_s": ("request_latency_seconds", "a request's time from arrival to end", ("node", "job")),
    "switch_s": ("switch_seconds", "a device-side transition (load or offload) of a switch", ("node", "device")),
}
PLACEMENT_GAUGES = {
    "slack": ("job_slack_ratio", "a job's slack: the step slowdown it accepts"),
    "measured_inflation": ("job_step_slowdown_ratio", "a job's step slowdown as measured over its last steps"),
    "inflation_predicted": ("job_step_slowdown_predicted_ratio", "the placer's predicted step slowdown of a job"),
    "phase_shift_s": ("job_phase_shift_seconds", "the start offset a job's placement chose"),
    "queueing_delay_s": ("job_admission_delay_seconds", "a job's admission time minus its submission time"),
}
TIERS = ("device", "host", "disk")


def device_node(metrics: dict, device: int) -> str:
    per_node = max(1, metrics["devices"] // max(1, metrics["nodes"]))
    return str(int(device) // per_node)


def state_job(state_id: str) -> str:
    """A state id is `JOB/MODEL` (a sampler snapshot's too)."""
    return state_id.split("/", 1)[0]


def families(m: dict, tenants: dict[str, str] | None = None) -> Iterable[Metric]:
    """The metric families of one `metrics()` snapshot; `tenants` (job -> tenant) adds plexrl_job_info."""
    yield _gauge("uptime_seconds", "seconds since the cluster started", m["uptime_s"])
    yield _gauge("devices", "devices in the cluster", m["devices"])
    yield _gauge("nodes", "node groups in the cluster", m["nodes"])
    for key, (name, text) in COUNTERS.items():
        yield _counter(name, text, m[key])
    transitions = CounterMetricFamily("plexrl_transitions", "state transitions, by kind", labels=["kind"])
    for kind, n in sorted(m["transitions"].items()):
        transitions.add_metric([kind], n)
    yield transitions
    busy = CounterMetricFamily("plexrl_device_busy_seconds", "device time spent: functions and device-side "
                               "transitions", labels=["node", "device"])
    for device, seconds in sorted(m["device_busy_s_per_device"].items()):
        busy.add_metric([device_node(m, device), str(device)], seconds)
    yield busy
    bandwidth = GaugeMetricFamily("plexrl_transfer_bandwidth_bytes_per_second", "measured transfer rate",
                                  labels=["kind"])
    for kind, gbps in sorted(m["bandwidth_gbps"].items()):
        bandwidth.add_metric([kind], gbps * 1e9)
    yield bandwidth
    yield from _budgets(m)
    yield from _jobs(m, tenants)
    yield from _states(m)
    queued = GaugeMetricFamily("plexrl_requests_queued", "requests waiting in a node group's queue", labels=["node"])
    for group, n in sorted(m["queued"].items()):
        queued.add_metric([str(group)], n)
    yield queued
    yield _gauge("jobs_waiting", "jobs waiting for admission", len(m["admission"]))
    for key, (name, text) in RECOVERY.items():
        yield _counter(name, text, m["recovery"].get(key, 0))
    yield from _histograms(m["histograms"])


def _budgets(m: dict) -> Iterable[Metric]:
    whole = GaugeMetricFamily("plexrl_device_memory_bytes", "a device's whole memory budget", labels=["node", "device"])
    arena = GaugeMetricFamily("plexrl_device_state_bytes", "a device's budget left for model states (its arena)",
                              labels=["node", "device"])
    for device, split in sorted(m["device_budget"].items()):
        labels = [device_node(m, device), str(device)]
        whole.add_metric(labels, split["device_memory_bytes"])
        arena.add_metric(labels, split["state_bytes"])
    yield whole
    yield arena


def _jobs(m: dict, tenants: dict[str, str] | None) -> Iterable[Metric]:
    counters = {key: CounterMetricFamily(f"plexrl_{name}", text, labels=["node", "job"])
                for key, (name, text) in JOB_COUNTERS.items()}
    gauges = {key: GaugeMetricFamily(f"plexrl_{name}", text, labels=["job"])
              for key, (name, text) in PLACEMENT_GAUGES.items()}
    for job, usage in sorted(m["jobs"].items()):
        node = usage["placement"].get("node")
        for key, family in counters.items():
            family.add_metric(["" if node is None else str(node), job], usage.get(key, 0))
    for job, placed in sorted(m["placement"].items()):
        for key, family in gauges.items():
            if placed.get(key) is not None:
                family.add_metric([job], placed[key])
    yield from counters.values()
    yield from gauges.values()
    if tenants is not None:
        info = GaugeMetricFamily("plexrl_job_info", "1 for each job, labelled with its tenant",
                                 labels=["job", "tenant"])
        for job, tenant in sorted(tenants.items()):
            info.add_metric([job, tenant], 1)
        yield info


def _states(m: dict) -> Iterable[Metric]:
    per_job: dict[tuple[str, str], int] = {}
    for state_id, where in m["residency"].items():
        tier = where.split(":", 1)[0]
        key = (state_job(state_id), tier)
        per_job[key] = per_job.get(key, 0) + 1
    family = GaugeMetricFamily("plexrl_job_states", "a job's model states by tier: device, host or disk",
                               labels=["job", "tier"])
    for (job, tier), n in sorted(per_job.items()):
        family.add_metric([job, tier], n)
    yield family


def _histograms(records: list[dict]) -> Iterable[Metric]:
    by_name: dict[str, HistogramMetricFamily] = {}
    for key, (name, text, labels) in HISTOGRAMS.items():
        by_name[key] = HistogramMetricFamily(f"plexrl_{name}", text, labels=list(labels))
    bounds = [f"{b:g}" for b in BUCKETS_S] + ["+Inf"]
    for r in sorted(records, key=lambda r: (r["name"], str(r["node"]), str(r["job"]), str(r["device"]))):
        name, text, labels = HISTOGRAMS[r["name"]]
        values = {"node": "" if r["node"] is None else str(r["node"]), "job": r["job"],
                  "device": "" if r["device"] is None else str(r["device"])}
        cumulative, buckets = 0, []
        for bound, count in zip(bounds, r["counts"]):
            cumulative += count
            buckets.append((bound, cumulative))
        by_name[r["name"]].add_metric([values[label] for label in labels], buckets, r["sum"])
    yield from by_name.values()


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"plexrl_{name}", text, value=value)


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"plexrl_{name}", text, value=value)


class ClusterCollector:
    """A prometheus-client collector reading `metrics()` (a callable: a cluster's metrics method)
    on each scrape; `tenants` (a callable, job -> tenant) labels jobs with their tenants."""

    def __init__(self, metrics: Callable[[], dict], tenants: Callable[[], dict[str, str]] | None = None):
        self._metrics, self._tenants = metrics, tenants

    def describe(self) -> list:
        return []  # no scrape at registration

    def collect(self) -> Iterable[Metric]:
        yield from families(self._metrics(), None if self._tenants is None else self._tenants())


def exposition(metrics: Callable[[], dict], tenants: Callable[[], dict[str, str]] | None = None) -> Callable[[], bytes]:
    """A function answering one scrape: the text format of a registry holding only this cluster."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(metrics, tenants))
    return lambda: generate_latest(registry)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
