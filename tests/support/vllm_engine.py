"""An engine process on vLLM's own OpenAI serving layer: its ``GET /v1/models`` route and LoRA registry, over HTTP.

    python tests/support/vllm_engine.py BASE_MODEL

Only the engine core is replaced (``vllm_probe.FakeEngine``). The fabric's resolver plugin is found through its
entry point by vLLM's ``load_general_plugins()``, configured by the FABRIC_* environment. Two test routes drive
the registry as traffic would: ``POST /test/request {"model": NAME}`` resolves NAME through vLLM's resolvers, as a
request naming an unknown model does; ``POST /test/unload {"lora_name": NAME}`` is vLLM's own
``unload_lora_adapter``. ``POST /v1/unload_lora_adapter`` is vLLM's runtime route as it answers with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true (the same handler call and replies; vLLM's own route module also needs the
SageMaker adapter package, not installed here). A resolved request answers the ``LoRARequest``'s int id and the
prefix-cache key vLLM derives from it (``kv_cache_utils._gen_lora_extra_hash_keys``). Prints ``engine listening on
PORT`` once uvicorn serves on a free port.
"""


import asyncio
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the tests package is importable


def build_app(base_model: str):
    from fastapi import FastAPI, Request
    from types import SimpleNamespace

    from fastapi.responses import JSONResponse, Response
    from vllm.v1.core.kv_cache_utils import _gen_lora_extra_hash_keys
    from vllm.entrypoints.openai.models import api_router
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest
    from vllm.lora.request import LoRARequest
    from vllm.plugins import load_general_plugins

    from tests.support.vllm_probe import FakeEngine

    load_general_plugins()
    app = FastAPI()
    api_router.attach_router(app)  # vLLM's GET /v1/models
    models = OpenAIServingModels(engine_client=FakeEngine(base_model), base_model_paths=[BaseModelPath(name=base_model, model_path=base_model)])
    app.state.openai_serving_models = models

    @app.post("/test/request")
    async def request(raw: Request) -> JSONResponse:
        name = (await raw.json())["model"]
        result = await models.resolve_lora(name)
        if isinstance(result, LoRARequest):
            key = _gen_lora_extra_hash_keys(SimpleNamespace(lora_request=result))  # vLLM's prefix-cache key of this LoRA's blocks
            return JSONResponse({"name": result.lora_name, "path": result.lora_path, "int_id": result.lora_int_id, "cache_key": repr(key)})
        return JSONResponse({"error": result.error.message}, status_code=result.error.code)

    @app.post("/test/unload")
    async def unload(raw: Request) -> JSONResponse:
        result = await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=(await raw.json())["lora_name"]))
        return JSONResponse({"result": result if isinstance(result, str) else result.error.message})

    @app.post("/v1/unload_lora_adapter")
    async def unload_route(raw: Request) -> Response:
        result = await models.unload_lora_adapter(UnloadLoRAAdapterRequest(**(await raw.json())))
        if isinstance(result, str):
            return Response(status_code=200, content=result)
        return JSONResponse(content=result.model_dump(), status_code=result.error.code)

    return app


def main() -> None:
    import uvicorn

    app = build_app(sys.argv[1])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    print(f"engine listening on {listener.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    asyncio.run(server.serve(sockets=[listener]))


if __name__ == "__main__":
    main()
