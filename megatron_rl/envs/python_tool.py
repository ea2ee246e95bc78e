"""`python`: the policy runs Python in a sandbox (sandbox.py) and answers from what it printed.

    env = PythonEnvironment(PythonConfig(sandbox={"cpu_seconds": 2, "memory_mb": 512}))
    env.reset(example)
    env.step('<tool_call>\\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\\n</tool_call>')
    # StepResult(observation="42\\n[exit code 0]", ...)
    env.step("Answer: 42")          # scored like calculator's final answer (answers.py)

Whatever ends the code is said in the observation: its output, then "[exit code N]", or
"[killed: CPU time limit of 2 s]", "[killed: wall-clock limit of 5 s]", "[killed: output passed
65536 bytes]" (8x the output kept: its first and last halves), "[killed by signal N]".  An exception (MemoryError, the sandbox's PermissionError for
a fork or a socket) is the code's traceback.  None of these is a score: the policy reads them.  A
sandbox that cannot start raises EnvError: the episode ends with env_error, never a silent zero.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.envs.answers import check_extractors
from megatron_rl.envs.calculator import QuestionToolEnvironment, tool_schema
from megatron_rl.envs.protocol import EnvError, StepResult
from megatron_rl.envs.sandbox import (OUTPUT_KILL_FACTOR, RunResult, Sandbox, SandboxConfig, SandboxError,
                                     choose_isolation)
from megatron_rl.envs.tool_calls import parse_tool_calls

TOOL_NAME = "python"
CALL_FORMAT = '<tool_call>\n{"name": "python", "arguments": {"code": "<python source>"}}\n</tool_call>'


@dataclasses.dataclass(kw_only=True)
class PythonConfig:
    """The `python` environment's section."""

    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    """Limits of each run (sandbox.py SandboxConfig)."""
    answer_extractors: list[str] = dataclasses.field(default_factory=lambda: ["answer_is", "last_number"])
    """How the final answer is found in the last turn (reward/math_verifier.py EXTRACTORS)."""

    def __post_init__(self) -> None:
        if isinstance(self.sandbox, dict):
            self.sandbox = SandboxConfig(**self.sandbox)
        check_extractors(self.answer_extractors)

    def preflight(self) -> dict:
        """At run start, on the node that runs it: the isolation the sandbox gets here (for the run manifest);
        SandboxError (one line: what the node lacks) where bubblewrap was asked for and cannot run."""
        return {"sandbox": choose_isolation(self.sandbox)}


def describe_run(run: RunResult, config: SandboxConfig) -> str:
    """The observation for one run: its output, then how it ended."""
    if run.killed_by == "cpu":
        end = f"[killed: CPU time limit of {config.cpu_seconds} s]"
    elif run.killed_by == "wall":
        end = f"[killed: wall-clock limit of {config.wall_seconds:g} s]"
    elif run.killed_by == "output":
        end = f"[killed: output passed {OUTPUT_KILL_FACTOR * config.output_bytes} bytes]"
    elif run.exit_code is not None and run.exit_code < 0:
        end = f"[killed by signal {-run.exit_code}]"
    else:
        end = f"[exit code {run.exit_code}]"
    output = run.output if not run.output or run.output.endswith("\n") else run.output + "\n"
    return output + end


class PythonEnvironment(QuestionToolEnvironment):
    name = "python"
    observation_role = "tool"

    def __init__(self, config: PythonConfig):
        super().__init__(config)
        try:
            self.sandbox = Sandbox(config.sandbox)
        except SandboxError as err:
            raise EnvError(str(err)) from None

    @property
    def system_prompt(self) -> str:
        return ("You can run Python: " + CALL_FORMAT + "\nYou see what it prints. When you know the result, "
                "reply with 'Answer: <value>' and no tool call.")

    @property
    def tools(self) -> list[dict]:
        return [tool_schema(TOOL_NAME, "Run a Python program (no network, no subprocesses) and see its output.",
                            "code", "the program; print what you want to see")]

    def step(self, action: str) -> StepResult:
        final = self.final_answer(action)
        if final is not None:
            return final
        calls, errors = parse_tool_calls(action)
        if errors or len(calls) != 1:
            why = errors[0] if errors else f"{len(calls)} tool calls; make exactly one per turn"
            return StepResult(f"Malformed tool call: {why}. Call it as {CALL_FORMAT}",
                              info={"tool_calls": max(len(calls) + len(errors), 1), "tool_errors": 1})
        call = calls[0]
        code = call.arguments.get("code")
        if call.name != TOOL_NAME or not isinstance(code, str):
            return StepResult(f"Error: call the tool {TOOL_NAME!r} with a \"code\" string argument",
                              info={"tool_calls": 1, "tool_errors": 1})
        try:
            run = self.sandbox.run(code)
        except SandboxError as err:
            raise EnvError(str(err)) from None
        failed = int(run.killed_by is not None or run.exit_code != 0)
        # a run killed by close() (the episode's step timed out) reads as killed by signal 9; no one reads it
        return StepResult(describe_run(run, self.config.sandbox), info={
            "tool_calls": 1, "tool_errors": failed, "tool_seconds": run.seconds,
            "sandbox_violations": len(run.violations)})

    def close(self) -> None:
        """Kill the code still running (the runner closes an environment whose step timed out)."""
        self.sandbox.kill()
