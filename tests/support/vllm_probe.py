"""Run vLLM's own plugin loader and OpenAI serving layer against fabric nodes; print what vLLM answers, as JSON.

    python tests/support/vllm_probe.py                      # load_general_plugins(): which resolvers registered
    python tests/support/vllm_probe.py BASE_MODEL LORA_NAME # ... then OpenAIServingModels.resolve_lora(LORA_NAME)
    python tests/support/vllm_probe.py --starts JSON        # vLLM's start-up once per environment in the JSON list
    python tests/support/vllm_probe.py --serve              # imports vLLM once, then forks one probe per request

``--serve`` is for the tests: a probe costs ~7 CPU-seconds, nearly all of it vLLM's imports. The server imports
what a probe imports, loads no plugin, and forks each probe from there: the child is a process of its own that
runs ``main`` as the command line would (its arguments, its whole environment, its stdout and stderr to files),
so vLLM's plugin loading still happens once per probe, from scratch.

vLLM's logging is its own (``vllm.logger``'s configuration; the tests point its stream at stderr). Only the engine core is replaced (``FakeEngine``: a model config naming the
base model, and ``add_lora`` recording what it is given); the plugin is found
through adapter-fabric's real ``vllm.general_plugins`` entry point, and the
request goes through vLLM's ``OpenAIServingModels`` as an HTTP request naming
an unknown model would. Configuration comes from the FABRIC_* environment,
as in an engine's container.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace


class FakeEngine:
    """The engine core's place: what OpenAIServingModels reads, and add_lora."""

    def __init__(self, base_model: str) -> None:
        self.model_config = SimpleNamespace(model=base_model, max_model_len=2048)
        self.renderer = None
        self.input_processor = None
        self.added: list = []

    async def add_lora(self, request) -> bool:
        self.added.append(request)
        return True


def configure_vllm_logging() -> None:
    """What ``vllm serve`` does first (vllm.entrypoints.cli.main: configure_logging_from_args): vLLM's handler on its ``vllm`` logger."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())


def starts(cases: list[dict[str, str]]) -> list[dict]:
    """For each environment: vLLM's plugin loading from scratch (its once-per-process flag and the registry reset),
    what registered, and what the plugin logged."""
    import io
    import logging
    import os

    import vllm.plugins
    from vllm.lora.resolver import LoRAResolverRegistry

    results = []
    for case in cases:
        for name in [n for n in os.environ if n.startswith("FABRIC_")]:
            del os.environ[name]
        os.environ.update(case)
        vllm.plugins.plugins_loaded = False
        LoRAResolverRegistry.resolvers.clear()
        captured = io.StringIO()
        handler = logging.StreamHandler(captured)
        logging.getLogger("vllm").addHandler(handler)  # vLLM's own logger: what reaches it reaches vLLM's log
        try:
            vllm.plugins.load_general_plugins()  # raises here if a plugin would stop vLLM from starting
        finally:
            logging.getLogger("vllm").removeHandler(handler)
        results.append({"registered": sorted(LoRAResolverRegistry.get_supported_resolvers()), "log": captured.getvalue()})
    return results


def main() -> None:
    configure_vllm_logging()
    if sys.argv[1:2] == ["--starts"]:
        print(json.dumps(starts(json.loads(sys.argv[2]))))
        return
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolverRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out: dict = {"registered": sorted(LoRAResolverRegistry.get_supported_resolvers())}
    if len(sys.argv) == 3:
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels

        base_model, lora_name = sys.argv[1], sys.argv[2]
        engine = FakeEngine(base_model)
        models = OpenAIServingModels(engine_client=engine, base_model_paths=[BaseModelPath(name=base_model, model_path=base_model)])
        result = asyncio.run(models.resolve_lora(lora_name))
        if isinstance(result, LoRARequest):
            out.update(kind="lora", name=result.lora_name, path=result.lora_path, added=len(engine.added))
        else:
            out.update(kind="error", code=result.error.code, message=result.error.message)
    print(json.dumps(out))


PRELOADED = (
    "vllm.config.logging",
    "vllm.logger",
    "vllm.plugins",
    "vllm.lora.request",
    "vllm.lora.resolver",
    "vllm.entrypoints.openai.models.protocol",
    "vllm.entrypoints.openai.models.serving",
)
PROBE_DEADLINE_S = 240.0  # a probe still running then is killed and answered rc -9


def serve() -> None:
    """Answer JSON lines on stdin, {"args": [...], "env": {...}, "stdout": PATH, "stderr": PATH}, each with {"rc": N}
    once its forked probe has ended; stops at end of input."""
    import importlib

    import vllm.plugins

    for name in PRELOADED:
        importlib.import_module(name)
    assert not vllm.plugins.plugins_loaded, "a preloaded module loaded vLLM's plugins: a probe would not load them itself"
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_forked(request)
        print(json.dumps({"rc": _wait(pid)}), flush=True)


def _run_forked(request: dict) -> None:
    code = 1
    try:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [__file__, *request["args"]]
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int) -> int:
    deadline = time.monotonic() + PROBE_DEADLINE_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main()
