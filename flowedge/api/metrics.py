"""Prometheus metrics for `GET /metrics`.

Request counters, tokens and latencies are this process's own (what it served); queue depth,
per-stage busy fraction and step time, readiness and the head's totals are read from the head's
status reply at scrape time, so they are as fresh as the stages' last heartbeat.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "client_error", "unauthorized", "unavailable", "failed", "cancelled")


class ApiMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._verified, self._accepted = 0, 0.0   # running sums behind mean_accept
        self.requests = Counter("flowedge_http_requests", "HTTP requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.failures = Counter("flowedge_failures", "Requests the cluster could not answer, by kind",
                                ["kind"], registry=r)
        self.in_flight = Gauge("flowedge_requests_in_flight", "Generation requests being answered now", registry=r)
        self.prompt_tokens = Counter("flowedge_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.tokens = Counter("flowedge_tokens_generated", "Tokens generated for answered requests", registry=r)
        self.verifications = Counter("flowedge_verifications", "Verification steps of answered requests",
                                     registry=r)
        self.accepted = Counter("flowedge_accepted_tokens", "Tokens accepted by those verification steps",
                                registry=r)
        self.mean_accept = Gauge("flowedge_mean_accepted_length",
                                 "Accepted tokens per verification step, over every answered request", registry=r)
        self.tokens_per_s = Gauge("flowedge_tokens_per_second", "Decoding speed of the last answered request",
                                  registry=r)
        self.latency = Histogram("flowedge_request_seconds", "Wall time of answered requests", registry=r,
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.first_token = Histogram("flowedge_first_token_seconds", "Time to the first token", registry=r,
                                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        # from the head's status
        self.head_up = Gauge("flowedge_head_up", "1 when the head answered the status request", registry=r)
        self.ready = Gauge("flowedge_cluster_ready", "1 when every stage is ready", registry=r)
        self.queue = Gauge("flowedge_queue_depth", "Requests at the head, queued or running", registry=r)
        self.live = {state: Gauge(f"flowedge_requests_{state}", f"Requests {state} at the head now", registry=r)
                     for state in ("queued", "running", "paused")}
        self.head_rate = Gauge("flowedge_head_tokens_per_second", "Tokens the head streams a second now, to "
                               "every client (over its last few seconds)", registry=r)
        self.head_load = Gauge("flowedge_head_load", "CPU use of the head process, in cores", registry=r)
        self.head_served = Gauge("flowedge_head_requests", "Requests the head has finished, by outcome (its "
                                 "own count, all clients): requests (answered), rejected (the client's "
                                 "mistake), failed (the cluster's), cancelled, and tokens streamed",
                                 ["outcome"], registry=r)
        self.busy = Gauge("flowedge_stage_busy_fraction", "Busy time over wall time since the stage's last "
                          "heartbeat", ["stage", "node"], registry=r)
        self.step_ms = Gauge("flowedge_stage_step_ms", "Median step time of the stage", ["stage", "node"],
                             registry=r)
        self.kv_tokens = Gauge("flowedge_stage_kv_tokens", "KV cache entries the stage holds", ["stage", "node"],
                               registry=r)
        self.stage_requests = Gauge("flowedge_stage_requests", "Requests the stage holds state for",
                                    ["stage", "node"], registry=r)
        self.rtt_ms = Gauge("flowedge_stage_rtt_ms", "Round trip of the head's link to the node, median of its "
                            "recent heartbeats", ["stage", "node"], registry=r)
        self.rss = Gauge("flowedge_node_rss_bytes", "Resident memory of each node", ["stage", "node"], registry=r)

    def answered(self, result: dict) -> None:
        """Fold one finished answer's totals in."""
        self.prompt_tokens.inc(int(result.get("prompt_tokens", 0)))
        self.tokens.inc(int(result.get("new_tokens", 0)))
        if result.get("verifications"):
            self.verifications.inc(result["verifications"])
            self.accepted.inc(result["verifications"] * result.get("mean_accept_len", 0.0))
            self._verified += result["verifications"]
            self._accepted += result["verifications"] * result.get("mean_accept_len", 0.0)
            self.mean_accept.set(self._accepted / self._verified)
        if result.get("tokens_per_s") is not None:
            self.tokens_per_s.set(result["tokens_per_s"])
        if result.get("client_wall_s") is not None:
            self.latency.observe(result["client_wall_s"])
        if result.get("first_token_s") is not None:
            self.first_token.observe(result["first_token_s"])

    def cluster(self, nodes: list[dict] | None) -> None:
        """Refresh the gauges read from the head's status (None: the head did not answer)."""
        for gauge in (self.busy, self.step_ms, self.kv_tokens, self.stage_requests, self.rss, self.head_served,
                      self.rtt_ms):
            gauge.clear()
        self.head_up.set(nodes is not None)
        if not nodes:
            self.ready.set(0)
            return
        head = nodes[0]
        self.ready.set(bool(head.get("ready")))
        self.queue.set(head.get("queue") or 0)
        self.head_load.set(head.get("load") or 0.0)
        live = head.get("requests") or {}
        for state, gauge in self.live.items():
            gauge.set(live.get(state) or 0)
        self.head_rate.set(live.get("tokens_per_s") or 0.0)
        for outcome, n in (head.get("served") or {}).items():
            if isinstance(n, (int, float)):
                self.head_served.labels(outcome).set(n)
        for n in nodes:
            labels = (str(n.get("stage", 0)), str(n.get("node_id") or "-"))
            if isinstance(n.get("rss_bytes"), (int, float)):
                self.rss.labels(*labels).set(n["rss_bytes"])
            if isinstance(n.get("rtt_ms"), (int, float)):   # stages and drafters
                self.rtt_ms.labels(*labels).set(n["rtt_ms"])
            if n.get("role") != "stage" or n.get("missing"):
                continue
            self.busy.labels(*labels).set(n.get("load") or 0.0)
            for gauge, key in ((self.step_ms, "step_ms_median"), (self.kv_tokens, "kv_tokens"),
                               (self.stage_requests, "requests")):
                if isinstance(n.get(key), (int, float)):
                    gauge.labels(*labels).set(n[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)
