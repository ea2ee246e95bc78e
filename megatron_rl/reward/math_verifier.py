"""Math answer verifier: final-answer extraction, exact comparison, reward components.

    cfg = RewardConfig(extractors=["boxed", "answer_is", "last_number"], format_extractors=["boxed"])
    score = score_response("... so the answer is \\boxed{3/4}.", "0.75", cfg)
    score.reward, score.correctness, score.format, score.overlong, score.grader_version

Extraction tries the configured extractors in order; the first that finds an answer wins:
  boxed          the last \\boxed{...} (nested braces allowed)
  answer_is      "answer: X" / "answer is X" (last occurrence)
  leading_number a number at the very start of the response (built-in digit tasks)
  last_number    the last number anywhere in the response

Comparison: both sides are parsed as exact rationals with `fractions.Fraction` (integers,
decimals, "a/b", \\frac{a}{b}, thousands separators), so "3/4" == "0.75" == "\\frac{3}{4}";
when either side does not parse, a normalised string comparison decides (whitespace, "$",
\\left/\\right, \\text{} removed).  No symbolic algebra (no sympy dependency).

Reward (components are reported separately, so they can be logged apart):
  correctness c ∈ {0, 1}: extracted answer equals the reference
  format      f ∈ {0, 1}: the answer was found by one of `format_extractors`
  overlong    o ∈ [-1, 0]: DAPO's soft overlong punishment (Yu et al. 2025, sec. 3.4) on the
              response length L with limit L_max and buffer L_buf:
              0 if L <= L_max - L_buf; (L_max - L_buf - L) / L_buf inside the buffer; -1 above.
  reward = w_c c + w_f f + w_o o, or just c with `correctness_only=True` (control runs).

Grading here is pure and in-process; the pool in megatron_rl.reward.pool runs it in worker
processes with a timeout, which is where timeouts and crashes become error codes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from fractions import Fraction
from typing import Any

GRADER_NAME = "math"
GRADER_REVISION = 1
EXTRACTORS = ("boxed", "answer_is", "leading_number", "last_number")
GRADERS = ("math", "math_verify", "reasoning_gym")

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_LEADING_RE = re.compile(r"\s*(" + _NUMBER + r")")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    extractors: list[str] = dataclasses.field(default_factory=lambda: ["boxed", "answer_is", "last_number"])
    """Answer extractors tried in order (first hit wins); names from EXTRACTORS."""
    format_extractors: list[str] = dataclasses.field(default_factory=lambda: ["boxed"])
    """An answer found by one of these earns the format reward; must be a subset of `extractors`."""
    correctness_weight: float = 1.0
    """w_c, weight of the correctness component."""
    format_weight: float = 0.1
    """w_f, weight of the format component."""
    overlong_limit: int | None = None
    """L_max, response length (tokens) at which the overlong penalty reaches -1; None disables it."""
    overlong_buffer: int = 0
    """L_buf, length of the linear ramp below L_max (0 = hard step at L_max)."""
    overlong_weight: float = 1.0
    """w_o, weight of the overlong penalty."""
    correctness_only: bool = False
    """Control: reward = correctness alone (other components still reported)."""
    grader: str = "math"
    """Who decides correctness: "math" (this module), "math_verify" (the math-verify package, for
    boxed math answers) or "reasoning_gym" (the task generator's own score_answer)."""
    timeout_s: float = 5.0
    """Per-response grading timeout in the pool; a timed-out worker is killed and replaced."""
    num_workers: int = 2
    """Grader worker processes in the pool."""
    function: str | None = None
    """Your own reward: "pkg.module:fn" or "path/to/file.py:fn", called per response as
    fn(prompt=, response=, answer=, **fields) -> float | {component: float} (reward/function.py).  It replaces
    the built-in grader; a component "correct" (0/1) is what eval reports as correctness."""

    def __post_init__(self) -> None:
        for name in ("extractors", "format_extractors"):
            for ex in getattr(self, name):
                if ex not in EXTRACTORS:
                    raise ValueError(f"{name}: unknown extractor {ex!r}; allowed: {list(EXTRACTORS)}")
        if not self.extractors:
            raise ValueError("extractors must name at least one extractor")
        missing = [ex for ex in self.format_extractors if ex not in self.extractors]
        if missing:
            raise ValueError(f"format_extractors {missing} are not in extractors {self.extractors}")
        if self.overlong_limit is not None:
            if self.overlong_limit <= 0:
                raise ValueError(f"overlong_limit must be > 0 or None, got {self.overlong_limit}")
            if not 0 <= self.overlong_buffer < self.overlong_limit:
                raise ValueError(f"overlong_buffer must be in [0, overlong_limit={self.overlong_limit}), got {self.overlong_buffer}")
        if self.function is not None:
            from megatron_rl.reward.function import absolute_ref, load_function

            if self.grader != "math":
                raise ValueError(f"reward.function replaces reward.grader; unset one (grader is {self.grader!r})")
            self.function = absolute_ref(self.function)
            load_function(self.function)  # import it now: a broken file fails the dry run, not step 1
        if self.grader not in GRADERS:
            raise ValueError(f"grader {self.grader!r} is not one of {list(GRADERS)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")

    def can_match_any(self, answers: list[str]) -> bool:
        """Whether this built-in grader could ever find one of `answers` (number-only extractors need answers that
        are numbers); a reward function or another grader is not judged here (True)."""
        if self.function or self.grader != "math" or not set(self.extractors) <= {"leading_number", "last_number"}:
            return True
        return any(parse_number(a) is not None for a in answers)

    def package_dirs(self) -> list[str]:
        """The local package of a reward function named by module path, for the run's Ray job to ship (grading
        runs in the driver's pool today; an actor that grades would need it)."""
        if not self.function or self.function.startswith("callable:"):
            return []
        from megatron_rl.plugins import local_package_dirs

        return local_package_dirs([self.function])

    def grader_version(self) -> str:
        """Name, revision and a hash of the scoring-relevant settings, e.g. 'math-1:3fa2c9d1'; of a reward
        function, its name and its source file's digest, e.g. 'function:my_reward@0c1d2e3f4a5b'."""
        if self.function is not None:
            from megatron_rl.reward.function import grader_version

            return grader_version(self.function)
        scoring = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("timeout_s", "num_workers")}
        digest = hashlib.sha256(json.dumps(scoring, sort_keys=True).encode()).hexdigest()[:8]
        if self.grader == "math":
            return f"{GRADER_NAME}-{GRADER_REVISION}:{digest}"
        from importlib.metadata import version

        package = {"math_verify": "math-verify", "reasoning_gym": "reasoning-gym"}[self.grader]
        return f"{self.grader}-{version(package)}:{digest}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Score:
    """One graded response.  On error (`error` set) every value is None: never a zero reward."""

    reward: float | None
    correctness: float | None
    format: float | None
    overlong: float | None
    error: str | None
    grader_version: str
    extracted: str | None = None
    detail: str = ""
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    """The weighted parts of `reward` (they sum to it): what a trajectory records."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def failed(cls, error: str, grader_version: str, detail: str = "") -> "Score":
        return cls(reward=None, correctness=None, format=None, overlong=None, error=error,
                   grader_version=grader_version, detail=detail)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_answer(response: str, extractors: list[str] | tuple[str, ...]) -> tuple[str | None, str | None]:
    """Return (answer, extractor_name) from the first extractor that finds one, else (None, None)."""
    for name in extractors:
        found: str | None = None
        if name == "boxed":
            found = _last_boxed(response)
        elif name == "answer_is":
            hits = _ANSWER_IS_RE.findall(response)
            found = hits[-1].strip().rstrip(".").strip() if hits else None
        elif name == "leading_number":
            m = _LEADING_RE.match(response)
            found = m.group(1) if m else None
        elif name == "last_number":
            hits = _NUMBER_RE.findall(response)
            found = hits[-1] if hits else None
        else:
            raise ValueError(f"unknown extractor {name!r}; allowed: {list(EXTRACTORS)}")
        if found:
            return found, name
    return None, None


def _normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def parse_number(text: str) -> Fraction | None:
    """Exact value of an int / decimal / fraction / \\frac string, else None."""
    text = _normalise(text)
    text = _FRAC_RE.sub(r"(\1)/(\2)", text)
    text = text.replace("(", "").replace(")", "")
    if not re.fullmatch(r"[-+]?[\d,]*\.?\d+(?:/[-+]?[\d,]*\.?\d+)?", text):
        return None
    num, _, den = text.partition("/")
    try:
        value = Fraction(num.replace(",", ""))
        if den:
            d = Fraction(den.replace(",", ""))
            if d == 0:
                return None
            value /= d
    except (ValueError, ZeroDivisionError):
        return None
    return value


def answers_match(predicted: str, reference: str) -> bool:
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return _normalise(predicted) == _normalise(reference)


def overlong_penalty(length: int, limit: int | None, buffer: int) -> float:
    """DAPO soft overlong punishment in [-1, 0] (0 when limit is None)."""
    if limit is None or length <= limit - buffer:
        return 0.0
    if length > limit or buffer == 0:
        return -1.0
    return (limit - buffer - length) / buffer


def score_response(response: str, reference: str, cfg: RewardConfig, length: int | None = None) -> Score:
    """Grade one response against the reference answer.  length defaults to len(response)."""
    answer, how = extract_answer(response, cfg.extractors)
    if cfg.grader == "math":
        correct = 1.0 if answer is not None and answers_match(answer, reference) else 0.0
    else:
        from megatron_rl.reward.external import external_correctness

        correct = external_correctness(cfg.grader, response, answer, reference)
    fmt = 1.0 if how is not None and how in cfg.format_extractors else 0.0
    over = overlong_penalty(len(response) if length is None else length, cfg.overlong_limit, cfg.overlong_buffer)
    components = reward_components(correct, fmt, over, cfg)
    return Score(reward=sum(components.values()), correctness=correct, format=fmt, overlong=over, error=None,
                 grader_version=cfg.grader_version(), extracted=answer, components=components)


def reward_components(correct: float, fmt: float, over: float, cfg: RewardConfig) -> dict[str, float]:
    """The weighted reward components; their sum is THE reward, for training and eval alike.

    `correctness_only` (control runs): {"correctness": c}, unweighted; otherwise
    {"correctness": w_c c, "format": w_f f, "overlong": w_o o}.
    """
    if cfg.correctness_only:
        return {"correctness": float(correct)}
    return {"correctness": cfg.correctness_weight * correct, "format": cfg.format_weight * fmt,
            "overlong": cfg.overlong_weight * over}


def grade(response: str, reference: str, cfg: RewardConfig, length: int | None = None,
          context: dict | None = None) -> Score:
    """The verifier pool's grader: the user's reward function when reward.function is set (reward/function.py;
    `context`: the prompt and the example's fields), else this module's verifier."""
    if not cfg.function:
        return score_response(response, reference, cfg, length)
    from megatron_rl.reward.function import CORRECT, call_function

    components = call_function(cfg.function, response, reference, context)
    return Score(reward=sum(components.values()), correctness=components.get(CORRECT), format=None, overlong=None,
                 error=None, grader_version=_function_version(cfg.function), components=components)


@functools.lru_cache(maxsize=8)
def _function_version(ref: str) -> str:
    """A reward function's grader version, read once per grading process (its file hashed once, not per
    response; the pool's processes live as long as the run's pool, whose own version is fixed at its start)."""
    from megatron_rl.reward.function import grader_version

    return grader_version(ref)
