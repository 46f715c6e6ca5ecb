"""A simulated flaky provider over the bundled example: how many runs still end with a correct kernel, and
what the failures cost in calls and resumes.

The provider answers like a competent model (a plan, the example's kernel, a stop decision) but a given
fraction of calls fail transiently (429 with a Gemini RetryInfo delay, a timeout, a 503), drawn from a
seeded RNG. Each run uses the agent graph with the real call-level retries; when a step still fails, the
run ends in its named state and is resumed (what `maxkernel resume THREAD` does), up to --max-resumes.
Kernel evaluations go through one results store, so only the first run pays for the harness.

Then one run per model-call budget (`--budgets`; the same seeded provider each time, up to three rounds, and
first with no budget for reference): the exact number of calls the provider received, failed and retried
ones included, against the budget, and the run's stop reason. A budget holds when the provider never
receives more calls than it allows.

    .venv/bin/python benchmarks/flaky_provider.py --runs 4 --failure-rate 0.3 --budgets 1,2,3,5,8
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from maxkernel.authors.model_calls import ModelCallError
from maxkernel.checkpointing import sqlite_checkpointer
from maxkernel.context import Context
from maxkernel.graph.agent import compile_graph

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "matmul_bias_relu"


class Transient(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code} {message}")
        self.code = code


def transient_failure(rng: random.Random) -> Exception:
    return rng.choice(
        [
            Transient(429, "RESOURCE_EXHAUSTED {'@type': 'type.googleapis.com/google.rpc.RetryInfo', "
                      "'retryDelay': '0.02s'}"),
            TimeoutError("read timed out"),
            Transient(503, "UNAVAILABLE: the model is overloaded"),
        ]
    )  # fmt: skip


class FlakyProvider(BaseChatModel):
    """Answers by what the prompt asks for; fails `failure_rate` of calls."""

    failure_rate: float
    seed: int
    calls: int = 0
    failures: int = 0
    rng: Any = None

    @property
    def _llm_type(self) -> str:
        return "flaky"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.rng is None:
            self.rng = random.Random(self.seed)
        self.calls += 1
        if self.rng.random() < self.failure_rate:
            self.failures += 1
            raise transient_failure(self.rng)
        prompt = str(messages[-1].content)
        if "— reflect" in prompt:
            text = '{"decision": "stop", "reason": "correct and tiled"}'
        elif "Write a plan" in prompt:
            text = "# Plan\nTiled (m, n, k) matmul, k innermost, f32 accumulator, bias+relu epilogue."
        else:
            text = "Here it is.\n```python\n" + (EXAMPLE / "kernel.py").read_text() + "```\n"
        usage = {"input_tokens": len(prompt) // 4, "output_tokens": len(text) // 4}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text, usage_metadata=usage))])


def one_run(
    index: int, args: argparse.Namespace, root: Path, max_model_calls: int | None = None, iterations: int = 1
) -> dict[str, Any]:
    model = FlakyProvider(failure_rate=args.failure_rate, seed=args.seed + index)
    graph = compile_graph(sqlite_checkpointer(root / "ck.sqlite"))
    ctx = Context(
        model="flaky",
        chat_model=model,
        tpu=["v5e"],
        store_path=str(root / "results.db"),
        work_dir=str(root / "work"),
        baseline=False,
        model_retries=args.retries,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        max_model_calls=max_model_calls,
    )
    config = {"configurable": {"thread_id": f"flaky-{index}-{max_model_calls}"}}
    inp: Any = {
        "task_path": str(EXAMPLE),
        "max_iterations": iterations,
        "tune_max_configs": 0,
        "out_dir": str(root / f"out-{index}"),
    }
    resumes, ended, reason = 0, "running", ""
    while True:
        try:
            graph.invoke(inp, config, context=ctx)
            values = graph.get_state(config).values
            ended, reason = values.get("status", "unknown"), values.get("stop_reason") or ""
            correct = values.get("best") is not None and values["best"].kind != "baseline"
            break
        except ModelCallError as exc:
            ended, correct = exc.kind, False
            if resumes >= args.max_resumes:
                break
            resumes += 1
            inp = None  # resume the thread at the failed step
    usage = graph.get_state(config).values.get("usage")
    return {"status": ended, "correct": correct, "calls": model.calls, "failed": model.failures,
            "resumes": resumes, "recorded": usage.model_calls if usage else 0, "reason": reason}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--failure-rate", type=float, default=0.3)
    p.add_argument("--retries", type=int, default=2, help="call-level retries (Context.model_retries)")
    p.add_argument("--max-resumes", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="1,2,3,4,5,8", help="model-call budgets, one run each ('' for none)")
    p.add_argument("--budget-seed", type=int, default=1, help="provider seed offset of the budget runs")
    args = p.parse_args()
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    start = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flaky-") as tmp:
        for i in range(args.runs):
            row = one_run(i, args, Path(tmp))
            rows.append(row)
            print(f"run {i}: {row['status']}, correct kernel from the model: {row['correct']}, "
                  f"calls {row['calls']} ({row['failed']} failed), resumes {row['resumes']}, "
                  f"calls in the run's usage {row['recorded']}", flush=True)  # fmt: skip
        held = True
        for budget in [None, *budgets] if budgets else []:
            row = one_run(args.budget_seed, args, Path(tmp), max_model_calls=budget, iterations=3)
            held = held and (budget is None or row["calls"] <= budget)
            verdict = "" if budget is None else ("held; " if row["calls"] <= budget else "OVERSHOT; ")
            print(f"budget {budget or 'none'}: the provider received {row['calls']} call(s) "
                  f"({row['failed']} failed), the run's usage says {row['recorded']}, resumes {row['resumes']}; "
                  f"{verdict}{row['status']}: {row['reason'] or 'finished'}", flush=True)  # fmt: skip
    ok = sum(r["correct"] for r in rows)
    calls = sum(r["calls"] for r in rows)
    failed = sum(r["failed"] for r in rows)
    print(
        f"\n{ok}/{len(rows)} runs ended with a correct kernel at a simulated failure rate of "
        f"{args.failure_rate:.0%} (call retries {args.retries}, resumes allowed {args.max_resumes}); "
        f"{calls} calls in all, {failed} failed ({calls / max(1, len(rows)):.1f} per run); "
        f"wall {time.monotonic() - start:.0f} s (measured on this machine)"
    )
    return 0 if ok == len(rows) and held else 1


if __name__ == "__main__":
    sys.exit(main())
