"""Engine metrics as Triton custom metric families, on the server's /metrics endpoint.

The reporter reads the engine's totals from its own thread; the step loop only adds to them.
It is handed Triton's Python-backend utilities module, so this package never imports Triton.
"""

from __future__ import annotations

from tritone.engine.core import PHASES, LLMEngine

_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0, 30.0]


class EngineMetrics:
    def __init__(self, pb_utils, engine: LLMEngine, model_name: str = "llm"):
        self.engine = engine
        family = pb_utils.MetricFamily
        labels = {"model": model_name}
        # A family must outlive its metrics, or setting them fails.
        self.families = []

        def metric(name, description, kind, **kwargs):
            self.families.append(family(name=name, description=description, kind=kind))
            return self.families[-1].Metric(labels=labels, **kwargs)

        g, c, h = family.GAUGE, family.COUNTER, family.HISTOGRAM
        self.running = metric("tritone_num_requests_running", "Requests in the running batch", g)
        self.waiting = metric("tritone_num_requests_waiting", "Requests waiting for admission", g)
        self.blocks_used = metric("tritone_kv_blocks_used", "KV cache blocks in use", g)
        self.blocks_free = metric("tritone_kv_blocks_free", "KV cache blocks free (cached or empty)", g)
        self.prefix_hit_rate = metric("tritone_prefix_cache_hit_rate",
                                      "Prompt tokens found in the prefix cache, fraction, over the last 1000 prompts", g)
        self.forward_busy = metric("tritone_forward_busy_fraction",
                                   "Fraction of engine wall time in the model forward pass, since the last report", g)
        self.prompt_tokens = metric("tritone_prompt_tokens_total", "Prompt tokens computed", c)
        self.generation_tokens = metric("tritone_generation_tokens_total", "Tokens generated", c)
        self.preemptions = metric("tritone_preemptions_total", "Requests preempted for recompute", c)
        self.forward_seconds = metric("tritone_forward_seconds_total", "Seconds in the model forward pass", c)
        phase_family = family(name="tritone_step_phase_seconds_total", kind=c,
                              description="Seconds of engine steps per phase: schedule, prepare (model inputs), "
                                          "forward, sample, update (engine thread); send (sender thread)")
        self.families.append(phase_family)
        self.phases = {phase: phase_family.Metric(labels={**labels, "phase": phase}) for phase in PHASES}
        self.steps = metric("tritone_steps_total", "Engine steps", c)
        self.idle_seconds = metric("tritone_engine_idle_seconds_total",
                                   "Seconds the engine thread waited with no request to run", c)
        self.ttft = metric("tritone_time_to_first_token_seconds", "Time from arrival to first token", h,
                           buckets=_LATENCY_BUCKETS)
        self.itl = metric("tritone_inter_token_latency_seconds", "Time between tokens of a request", h,
                          buckets=_LATENCY_BUCKETS)
        # Counters are reported as increments of the engine's running totals since the last report.
        self._last: list[float] | None = None
        self._last_wall = None

    def report(self, now: float) -> None:
        engine, stats, bm = self.engine, self.engine.stats, self.engine.block_manager
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.blocks_used.set(bm.num_used_blocks)
        self.blocks_free.set(bm.num_free_blocks)
        self.prefix_hit_rate.set(bm.prefix_stats.hit_rate)
        counters = [(self.prompt_tokens, stats.num_prompt_tokens), (self.generation_tokens, stats.num_generation_tokens),
                    (self.preemptions, engine.scheduler.num_preemptions), (self.forward_seconds, stats.forward_seconds),
                    (self.steps, stats.num_steps), (self.idle_seconds, stats.idle_seconds)]
        counters += [(self.phases[phase], stats.phase_seconds[phase]) for phase in PHASES]
        totals = [total for _, total in counters]
        deltas = [total - last for total, last in zip(totals, self._last or [0] * len(totals))]
        for (metric, _), delta in zip(counters, deltas):
            if delta > 0:
                metric.increment(delta)
        if self._last_wall is not None and now > self._last_wall:
            self.forward_busy.set(min(1.0, deltas[3] / (now - self._last_wall)))
        self._last, self._last_wall = totals, now
        ttft, itl = stats.take_latencies()
        for value in ttft:
            self.ttft.observe(value)
        for value in itl:
            self.itl.observe(value)
