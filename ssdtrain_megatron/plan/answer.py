"""The planner's answer to a job, as one value: what the job as given runs at, the best layouts
on its GPUs and global batch without and with offload, and the model's error band with the
verdict it allows (docs/design.md, "From a job to its settings").

:func:`answer` computes it from a :class:`~ssdtrain_megatron.plan.job.Job` (the one the door
parsed) and the job's size; ``ssdtrain plan`` renders it (``--json``: ``answer``). Pure: the
analytic model, no argparse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from .baseline import best_with_offload, best_without_offload, describe
from .fit import DEFAULT_RESERVE_BYTES
from .job import Job, Settings, job_settings
from .published import MODEL_ERROR, ModelError, beyond_error
from .search import Layout


@dataclass(frozen=True)
class Answer:
    """One job's answer (module docstring)."""

    job_tokens_per_s_per_gpu: float
    """The job as given: keeping everything without --ssd-offload or with policy keep, else
    its plan."""
    job_iteration_s: float
    job_offloads: bool
    time_terms_s: Dict[str, Any]
    """Seconds by term of the job's layer and step (plan/step_time.py); empty on a node
    without a GPU kind."""
    best_without: Optional[Layout]
    best_with: Optional[Layout]
    error: ModelError

    @property
    def gain(self) -> Optional[float]:
        """The best with offload over the best without (None where either is missing)."""
        if self.best_without is None or self.best_with is None:
            return None
        return self.best_with.tokens_per_s_per_gpu / self.best_without.tokens_per_s_per_gpu

    @property
    def verdict(self) -> str:
        """'offload pays', 'within the model's error', 'does not pay', 'only offload fits' or
        'nothing fits'."""
        if self.best_with is None:
            return "nothing fits" if self.best_without is None else "does not pay"
        if self.best_without is None:
            return "only offload fits"
        gain = self.gain
        if gain <= 1:
            return "does not pay"
        return "offload pays" if beyond_error(gain, self.error) else "within the model's error"

    def to_dict(self) -> Dict[str, Any]:
        def layout(x: Optional[Layout]) -> Optional[Dict[str, Any]]:
            if x is None:
                return None
            s = x.shape
            return {"layout": describe(x), "tp": s.tp, "pp": s.pp, "vp": s.vp, "cp": s.cp,
                    "dp": s.dp, "micro_batch": s.micro_batch, "recompute": s.recompute,
                    "distributed_optimizer": s.distributed_optimizer,
                    "iteration_s": x.plan.iteration_s,
                    "tokens_per_s_per_gpu": x.tokens_per_s_per_gpu}

        return {"job_tokens_per_s_per_gpu": self.job_tokens_per_s_per_gpu,
                "job_iteration_s": self.job_iteration_s, "job_offloads": self.job_offloads,
                "time_terms_s": self.time_terms_s, "best_without_offload": layout(self.best_without),
                "best_with_offload": layout(self.best_with), "gain": self.gain,
                "verdict": self.verdict,
                "model_error": {"median": self.error.median, "low": self.error.low,
                                "high": self.error.high, "runs": self.error.runs,
                                "line": self.error.line()}}


def job_as_given(job: Job, settings: Settings, gpus: int, global_batch: int) -> Dict[str, Any]:
    """The job's own tokens/s per GPU, iteration, whether it offloads, and its time terms."""
    st = settings.stage
    keeps = settings.config.policy == "keep" or job.given.get("policy") == "no --ssd-offload"
    iteration = st.keep_iteration_s if keeps or settings.plan is None else settings.plan.iteration_s
    return {"job_tokens_per_s_per_gpu": global_batch * job.shape.seq_len / iteration / gpus,
            "job_iteration_s": iteration, "job_offloads": not keeps,
            "time_terms_s": dict(st.terms)}


def answer(job: Job, gpus: int, global_batch: int, settings: Optional[Settings] = None,
           reserve: int = DEFAULT_RESERVE_BYTES) -> Answer:
    """The answer to ``job`` on ``gpus`` GPUs at ``global_batch`` sequences per iteration.

    Raises:
        ValueError: the job has no model, or its settings cannot be made (one line)."""
    if job.shape is None:
        raise ValueError("no model to plan: the job has no model shape")
    settings = settings if settings is not None else job_settings(job)
    given = job_as_given(job, settings, gpus, global_batch)
    keep_last = settings.config.keep_last_layers
    node = job.node
    return Answer(given["job_tokens_per_s_per_gpu"], given["job_iteration_s"],
                  given["job_offloads"], given["time_terms_s"],
                  best_without_offload(job.shape, gpus, global_batch, node,
                                       keep_last_layers=keep_last, reserve=reserve),
                  best_with_offload(job.shape, gpus, global_batch, node,
                                    keep_last_layers=keep_last, reserve=reserve),
                  MODEL_ERROR)


__all__ = ["Answer", "answer", "job_as_given"]
