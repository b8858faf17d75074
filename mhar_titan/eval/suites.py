"""Named task suites: a list of lm-eval tasks with their settings, so that a pair is judged on the same tasks,
shots and metrics every time (`--suite paper`) instead of a `--tasks` list retyped per run.

`paper` is the 8B evaluation of arXiv 2607.27230 (section 3.3, Table 3: base / plain CPT / +MHAR on the final
EMA checkpoints), mapped onto lm-evaluation-harness 0.4.13's own tasks (their YAMLs checked by
tests/test_eval_suites.py: task names, datasets, shots, metric and filter names, which ones run generated code):

| paper | lm-eval task | shots | Table 3 metric (lm-eval key) | dataset |
|---|---|---|---|---|
| MMLU | mmlu (57 subjects) | 5 | acc,none | cais/mmlu |
| GPQA | gpqa_main_zeroshot | 0 | acc,none | Idavidrein/gpqa (gpqa_main; gated) |
| GSM8K | gsm8k | 5 | exact_match,strict-match | openai/gsm8k (main) |
| MATH | minerva_math (7 subjects) | 4 | math_verify,none | EleutherAI/hendrycks_math |
| HumanEval | humaneval | 0 | pass@1,create_test | openai/openai_humaneval |
| MBPP | mbpp | 3 | pass_at_1,none | google-research-datasets/mbpp (full) |

MMLU's shots are not stated in the paper: 5, MMLU's own protocol for base models (Hendrycks et al.; the Llama 3
base-model reports), the first five of each subject's dev split (lm-eval's `first_n`); lm-eval's
default is 0. Its `mmlu` accuracy is the group's, weighted by subject size (the mean over all 14,042 questions).
MATH: Minerva's prompt and its 4 fixed examples, scored by the math_verify checker as the paper does (lm-eval
also reports the template-strict `exact_match`; it needs `pip install 'lm-eval[math]==0.4.13'`). HumanEval and
MBPP: greedy decoding (the YAMLs' do_sample false), pass@1; they run the generated code, so they need
`--confirm-run-unsafe-code` (lm-eval's confirm_run_unsafe_code) and HF evaluate's `code_eval` module cached.
Every table shows all of a task's metrics; the suite's metric is the one plotted over steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from mhar_titan.eval.harness import UNSAFE_FLAG, TaskRefused


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: lm-eval's name, the shots it runs with, the metric the suite reports, its dataset."""

    task: str
    num_fewshot: int
    metric: str  # lm-eval's results key, "metric,filter"
    dataset: str
    code: bool = False  # runs the code the model generates (lm-eval's unsafe_code)
    label: str = ""  # the paper's name for it


SUITES: dict[str, tuple[SuiteTask, ...]] = {
    "paper": (
        SuiteTask("mmlu", 5, "acc,none", "cais/mmlu", label="MMLU"),
        SuiteTask("gpqa_main_zeroshot", 0, "acc,none", "Idavidrein/gpqa", label="GPQA"),
        SuiteTask("gsm8k", 5, "exact_match,strict-match", "openai/gsm8k", label="GSM8K"),
        SuiteTask("minerva_math", 4, "math_verify,none", "EleutherAI/hendrycks_math", label="MATH"),
        SuiteTask("humaneval", 0, "pass@1,create_test", "openai/openai_humaneval", code=True, label="HumanEval"),
        SuiteTask("mbpp", 3, "pass_at_1,none", "google-research-datasets/mbpp", code=True, label="MBPP"),
    ),
}


@dataclass(frozen=True)
class Request:
    """The tasks a command evaluates: their names, each suite task's shots (None: --num-fewshot or the task's own),
    the metric to plot per task (None: all of its metrics), and the suite they come from."""

    names: list[str]
    shots: dict[str, int] | None = None
    metrics: dict[str, str] | None = None
    suite: str | None = None


def requested(tasks: str | None, suite: str | None, num_fewshot: int | None, confirm_unsafe: bool) -> Request:
    """--tasks or --suite as a Request; bad input refused in one line before anything is loaded (a suite's code
    tasks without the confirmation among them: known here, before lm-eval builds its index)."""
    if bool(tasks) == bool(suite):
        raise TaskRefused("give either --tasks or --suite (one of them)")
    if tasks:
        return Request([t for t in tasks.split(",") if t])
    if suite not in SUITES:
        raise TaskRefused(f"--suite {suite!r}: unknown; the suites are {', '.join(SUITES)}")
    if num_fewshot is not None:
        raise TaskRefused(f"--num-fewshot with --suite {suite}: the suite sets each task's shots (suites.py)")
    members = SUITES[suite]
    code = [t.task for t in members if t.code]
    if code and not confirm_unsafe:
        raise TaskRefused(
            f"--suite {suite}: {', '.join(code)} run the code the model generates (lm-eval's unsafe_code); pass "
            f"{UNSAFE_FLAG} to allow it (best in a sandbox: a container without network or credentials)"
        )
    return Request(
        [t.task for t in members], {t.task: t.num_fewshot for t in members}, {t.task: t.metric for t in members}, suite
    )
