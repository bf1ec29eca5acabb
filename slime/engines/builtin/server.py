"""HTTP server of the built-in engine: SGLang's endpoint names, bodies and response shapes.

    slime engine --model runs/tiny-kit/model --host 127.0.0.1 --port 30000
    python -m slime.engines.builtin --model ... (the same)

Errors are HTTP 400 with the body SGLang 0.5.23 gives for a refused request, `{"error": {"message": ...}}`
(checked against a real server: tests/engines/test_protocol_conformance.py); a bad request never
stops the server. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from contextlib import asynccontextmanager
from typing import Any

import pydantic_core
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from slime.config.engine_flags import DTYPES
from slime.engines.builtin.engine import BuiltinEngine, EngineArgs
from slime.engines.builtin.sampling import BadRequestError, SamplingParams
from slime.errors import SlimeError

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _answer(result: dict[str, Any]) -> JSONResponse:
    """SGLang's weight-update answer: {"success", "message", ...}, 200 or 400."""
    return JSONResponse(result, status_code=200 if result["success"] else 400)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def create_app(engine: BuiltinEngine) -> FastAPI:
    """The FastAPI app serving `engine`; the engine is shut down with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(lifespan=lifespan, openapi_url=None)

    @app.exception_handler(BadRequestError)
    async def bad_request(request: Request, exc: BadRequestError) -> JSONResponse:
        return _error(str(exc))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        # serialised by pydantic-core (FastAPI's own serialiser): a 128-token reply with log-probs took
        # ~4.8 ms through jsonable_encoder + json.dumps and ~2.3 ms through json.dumps alone, 0.4 ms
        # here (CPU dev machine); 256 replies finish in the same step, on the thread admitting requests
        result = await engine.generate(await _json_body(request))
        started = time.perf_counter()
        payload = pydantic_core.to_json(result)
        engine.scheduler.stats.replied(time.perf_counter() - started)
        return Response(payload, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.scheduler.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 when the model thread can produce a token (immediately when it is already busy)."""
        if not engine.scheduler.alive:
            return Response(status_code=503)
        if engine.scheduler.busy or engine.scheduler.paused:
            return Response(status_code=200)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        try:
            await asyncio.wait_for(engine.scheduler.submit([0], params, "HEALTH_CHECK"), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, BadRequestError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return engine.server_info()

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return [{"dp_rank": 0, **engine.scheduler.load()}]

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        if not isinstance(body.get("new_version"), str):
            raise BadRequestError("update_weight_version needs 'new_version' (a string)")
        if body.get("abort_all_requests"):
            engine.scheduler.abort(abort_all=True)
        engine.scheduler.weight_version = body["new_version"]
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    @app.get("/get_weight_version")  # not in SGLang 0.5.23 (there: /model_info); kept for convenience
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.scheduler.weight_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = engine.args.served_model_name or engine.args.model_path
        return {"object": "list", "data": [{"id": name, "object": "model", "root": name, "owned_by": "slime",
                                            "max_model_len": engine.scheduler.context_length}]}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        if not body.get("abort_all") and not body.get("rid"):
            raise BadRequestError("give 'rid' or 'abort_all': true")
        engine.scheduler.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all")))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation() -> dict[str, str]:
        engine.scheduler.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        engine.scheduler.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # no prefix cache to flush; like SGLang, refuse while requests are running
        if engine.scheduler.busy:
            return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _json_body(request)
        if not isinstance(body.get("model_path"), str):
            raise BadRequestError("update_weights_from_disk needs 'model_path' (a directory of safetensors)")
        if body.get("abort_all_requests"):
            engine.scheduler.abort(abort_all=True)
        result = await asyncio.to_thread(engine.update_weights_from_disk, body["model_path"], body.get("weight_version"))
        return _answer(result)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        result = await asyncio.to_thread(engine.load_lora_adapter, await _json_body(request))
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        result = await asyncio.to_thread(engine.unload_lora_adapter, await _json_body(request))
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    @app.post("/weights_checker")
    async def weights_checker(request: Request) -> JSONResponse:
        body = await _json_body(request)
        return _answer(await asyncio.to_thread(engine.check_weights, body.get("action", "checksum")))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        return _answer(await asyncio.to_thread(engine.update_weights_from_tensor, await _json_body(request)))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        return _answer(await asyncio.to_thread(engine.init_weights_update_group, await _json_body(request)))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        return _answer(await asyncio.to_thread(engine.update_weights_from_distributed, await _json_body(request)))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        return _answer(await asyncio.to_thread(engine.destroy_weights_update_group, await _json_body(request)))

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation() -> Response:
        await asyncio.to_thread(engine.release_memory)
        return Response(status_code=200)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation() -> Response:
        await asyncio.to_thread(engine.resume_memory)
        return Response(status_code=200)

    return app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slime engine", description="Built-in SGLang-protocol inference server.")
    parser.add_argument("--model", "--model-path", dest="model_path", required=True, help="HF model directory")
    parser.add_argument("--tokenizer-path", help="default: the model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--kv-cache", default="auto", choices=["auto", "slots", "dynamic"],
                        help="auto: a slot cache with graph-captured decoding on CUDA (Qwen2/Qwen3/Qwen3-MoE/GLM-4.5/"
                             "Llama), "
                             "else the dynamic cache")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="slot mode: decode eagerly")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="slot mode: do not launch the next decode before the host has this step's tokens")
    parser.add_argument("--disable-fused-projections", action="store_true",
                        help="slot mode: run q/k/v and gate/up as separate GEMMs (default: one GEMM each per layer)")
    parser.add_argument("--disable-sampler-compile", action="store_true",
                        help="CUDA: sample eagerly (default: without top-k/top-p/greedy rows, the sampler is one "
                             "torch.compile'd function; same draws)")
    parser.add_argument("--disable-slot-prefill", action="store_true",
                        help="slot mode: prefill prompts by the transformers forward and copy their keys/values into "
                             "the slots (default: the slot decoder's own layers write them there directly)")
    parser.add_argument("--chunked-prefill-size", type=int, default=EngineArgs.chunked_prefill_size,
                        help="slot prefill: at most this many padded prompt tokens (rows x longest prompt) per forward "
                             "pass; a larger admitted group is prefilled in row chunks, which bounds the prefill's "
                             "activation memory (a single longer prompt still takes one pass); -1: no limit")
    parser.add_argument("--disable-fused-kv-write", action="store_true",
                        help="CUDA slot decode: rotary, then the key and value cache writes as separate kernels "
                             "(default: one torch.compile'd function rotates q/k and writes k/v in place)")
    parser.add_argument("--max-slot-tokens", type=int, default=4096,
                        help="slot mode: the most tokens (prompt + new) one request may hold")
    parser.add_argument("--mem-fraction-static", type=float,
                        help="GPU shared with a train rank: cap this engine at this part of the GPU's memory and "
                             "size the slot KV cache to fit (slime/engines/builtin/memory.py)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve /load_lora_adapter and /unload_lora_adapter (one adapter, merged into the weights)")
    parser.add_argument("--max-lora-rank", type=int, help="refuse adapters of a higher rank")
    parser.add_argument("--lora-target-modules", nargs="+",
                        help="HF module names adapters may target (q_proj ... down_proj, or all); default: any")
    parser.add_argument("--admission-window-ms", type=float, default=10.0,
                        help="admit the waiting requests once none has arrived for this long (or they fill the "
                             "free rows, or the first waited 200 ms); a burst arriving over HTTP is then "
                             "prefilled as one group")
    parser.add_argument("--disable-gc-freeze", action="store_true",
                        help="let Python's garbage collector walk the model's objects in full collections "
                             "(default: frozen at start and after the first burst; a full walk took 0.3 s)")
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                        help="split the model over this many devices (cuda:i .. cuda:i+N-1 for --device cuda:i; CPU "
                             "processes on the CPU), one process each, this one serving HTTP: attention heads, KV "
                             "heads and MLP/expert slices per rank, embeddings and lm_head replicated "
                             "(docs/engines.md, Tensor parallelism)")
    parser.add_argument("--log-level", default="info")
    return parser


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """The engine's arguments from the server's parsed flags (the server process freezes the GC)."""
    return EngineArgs(**{k: v for k, v in vars(args).items() if k not in ("log_level", "disable_gc_freeze")},
                      gc_freeze=not args.disable_gc_freeze)


def _exit_with_rank(rank: int, code: int | None) -> None:
    logger.critical("tensor-parallel rank %d exited (code %s): the engine exits", rank, code)
    logging.shutdown()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):  # else transformers' hub-id traceback
        print(f"error: --model {args.model_path}: not a local HF model directory (no config.json in it)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = engine_args_from(args)
    try:
        engine = BuiltinEngine(engine_args)
    except SlimeError as exc:  # a flag or model the engine refuses: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if engine.tp is not None:  # a rank gone: this engine can no longer run its model, so it leaves too
        engine.tp.on_worker_exit = _exit_with_rank
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning")
    return 0
