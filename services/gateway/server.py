"""The public Generation service: thin servicer over the router, one error boundary."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.errors import PeerUnavailable, SpecdecError
from common.rpc import describe, status_for
from common.tokenizer import Tokenizer
from services.gateway import convert
from services.gateway.detokenize import RoundDecoder
from services.gateway.router import Router
from services.gateway.sequence import Delta, Generation
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """The gateway's error boundary: our exception types -> specific status codes, INTERNAL last."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, SpecdecError):
        log.exception("internal error", exc_info=exc)
    await context.abort(code, describe(exc))


class GenerationServicer(gpb_grpc.GenerationServicer):
    def __init__(self, router: Router, tokenizer: Tokenizer) -> None:
        self.router, self.tok = router, tokenizer
        # tokenizing (and applying the chat template) takes time in proportion to the input: never on the loop
        self._tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    @property
    def info(self):
        return self.router.link.info

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    async def _run(self, request: gpb.GenerateRequest) -> tuple[Generation, AsyncIterator[Delta]]:
        info = self.info
        req = await self._off_loop(convert.gen_request, request, self.tok, info.max_context, info)
        gen = Generation(request=req, decoder=RoundDecoder(self.tok), eos_token_id=self.tok.eos_token_id)
        self.router.metrics.prompt_tokens.inc(len(req.prompt_ids))
        return gen, self.router.generate(gen)

    def _final(self, gen: Generation) -> dict:
        return dict(
            finish_reason=convert.FINISH[gen.finish],
            usage=convert.usage(len(gen.request.prompt_ids), len(gen.token_ids)),
            speculation=convert.speculation(gen.stats),
        )

    async def Generate(self, request, context):
        try:
            gen, deltas = await self._run(request)
            async for d in deltas:
                msg = convert.stream_message(d)
                if d.finish is not None:
                    for k, v in self._final(gen).items():
                        if k == "finish_reason":
                            msg.finish_reason = v
                        else:
                            getattr(msg, k).CopyFrom(v)
                yield msg
        except Exception as e:  # noqa: BLE001 - the boundary
            await _abort(context, e)

    async def Complete(self, request, context):
        try:
            gen, deltas = await self._run(request)
            async for _ in deltas:
                pass
            return gpb.CompleteResponse(token_ids=gen.token_ids, text=gen.text, **self._final(gen))
        except Exception as e:  # noqa: BLE001 - the boundary
            await _abort(context, e)

    async def Tokenize(self, request, context):
        try:
            convert.check_input_size(request, self.tok, self.info.max_context)  # bounded work before tokenizing
            ids = await self._off_loop(convert.prompt_ids, request, self.tok)
            return gpb.TokenizeResponse(token_ids=ids, tokens=self.tok.tokens(ids))
        except Exception as e:  # noqa: BLE001 - the boundary
            await _abort(context, e)

    async def GetModelInfo(self, request, context):
        try:
            info = await self.router.link.probe()
            if info is None:
                raise PeerUnavailable("the verifier does not answer")
            return gpb.ModelInfo(
                model=info.model,
                vocab_size=info.vocab_size,
                max_context=info.max_context,
                eos_token_id=self.tok.eos_token_id,
                drafter=info.drafter or "none",
                drafting_top_k=info.drafting_top_k,
                drafting_steps=info.drafting_steps,
                verify_tree_size=info.verify_tree_size,
                dtype=info.dtype,
                device=info.device,
                speculation_degraded=info.speculation_degraded,
                speculation_policy=info.speculation_policy,
                policy_choices=info.policy_choices,
                policy_estimates=info.policy_estimates,
                engine_time=info.engine_time,
                engine_calls=info.engine_calls,
            )
        except Exception as e:  # noqa: BLE001 - the boundary
            await _abort(context, e)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
