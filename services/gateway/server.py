"""The public Generation service: thin servicer over the scheduler, one error boundary."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.errors import SpecdecError
from common.rpc import describe, status_for
from common.tokenizer import Tokenizer
from services.gateway import convert
from services.gateway.detokenize import RoundDecoder
from services.gateway.scheduler import Scheduler
from services.gateway.sequence import Delta, Generation
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """The gateway's error boundary: our exception types -> specific status codes, INTERNAL last."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, SpecdecError):
        log.exception("internal error", exc_info=exc)
    await context.abort(code, describe(exc))


class GenerationServicer(gpb_grpc.GenerationServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        verifier_info: pb.InfoResponse,
        draft_info: pb.DraftInfoResponse | None,
    ) -> None:
        self.scheduler, self.tok = scheduler, tokenizer
        self.vinfo, self.dinfo = verifier_info, draft_info
        # tokenizing (and applying the chat template) takes time in proportion to the input: never on the loop
        self._tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    async def _run(self, request: gpb.GenerateRequest) -> tuple[Generation, AsyncIterator[Delta]]:
        req = await self._off_loop(convert.gen_request, request, self.tok, self.vinfo.max_context, self.dinfo)
        gen = Generation(request=req, decoder=RoundDecoder(self.tok), eos_token_id=self.tok.eos_token_id)
        return gen, self.scheduler.generate(gen)

    def _final(self, gen: Generation) -> dict:
        n = len(gen.token_ids)
        return dict(
            finish_reason=convert.FINISH[gen.finish],
            usage=convert.usage(len(gen.request.prompt_ids), n),
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
            ids = await self._off_loop(convert.prompt_ids, request, self.tok)
            return gpb.TokenizeResponse(token_ids=ids, tokens=self.tok.tokens(ids))
        except Exception as e:  # noqa: BLE001 - the boundary
            await _abort(context, e)

    async def GetModelInfo(self, request, context):
        d = self.dinfo
        return gpb.ModelInfo(
            model=self.vinfo.model,
            vocab_size=self.vinfo.vocab_size,
            max_context=self.vinfo.max_context,
            eos_token_id=self.tok.eos_token_id,
            drafter=d.drafter if d else "none",
            drafting_top_k=d.drafting_top_k if d else 0,
            drafting_steps=d.drafting_steps if d else 0,
            verify_tree_size=d.verify_tree_size if d else 0,
            dtype=self.vinfo.dtype,
            device=self.vinfo.device,
            speculation_degraded=self.scheduler.speculation_degraded,
            speculation_policy=self.scheduler.policy.name,
            policy_choices=[
                gpb.PolicyChoice(tree=gpb.TreeShape(depth=s.depth, nodes=s.nodes), rounds=n)
                for s, n in sorted(self.scheduler.choices.items())
            ],
        )

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
