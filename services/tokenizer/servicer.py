"""TokenizerService: protobuf <-> `Tokenization` calls, and the per-RPC metrics.

Synchronous handlers: the service runs on a synchronous grpc server (see main)."""
from __future__ import annotations

import time

import grpc

from services.tokenizer import metrics
from services.tokenizer.tokenizing import (ChatTurn, DecodeInput, EncodeInput, Encoded,
                                           Tokenization)
from tokenserve.runtime import wire
from tokenserve.runtime.errors import InvalidArgument, ServiceError
from tokenserve.tokenizer.v1 import tokenizer_pb2 as pb

SERVICE_NAME = "tokenserve.tokenizer.v1.TokenizerService"


def add_to_server(servicer: "TokenizerServicer", server: grpc.Server) -> None:
    """Like the generated `add_TokenizerServiceServicer_to_server`, but requests with invalid
    UTF-8 reach the handler as `BadRequest` (INVALID_ARGUMENT naming the field) instead of
    failing inside grpc as INTERNAL."""
    wire.add_servicer(servicer, server, pb, "TokenizerService")


def _encode_input(req: pb.EncodeRequest) -> EncodeInput:
    kind = req.WhichOneof("input")
    common = dict(add_generation_prompt=req.add_generation_prompt,
                  add_special_tokens=req.add_special_tokens, parse_special=req.parse_special)
    if kind == "text":
        return EncodeInput(text=req.text, **common)
    if kind == "chat":
        turns = tuple(ChatTurn(m.role, m.content) for m in req.chat.messages)
        return EncodeInput(messages=turns, **common)
    return EncodeInput(**common)


def _batch_model(model: str, items, *, what: str = "requests") -> None:
    for i, item in enumerate(items):
        if item.model and item.model != model:
            raise InvalidArgument(
                f"{what}[{i}].model is {item.model!r} but the batch is for {model!r}: "
                "leave it empty or equal to the batch's model")


def _encoded_pb(e: Encoded) -> pb.EncodeResponse:
    return pb.EncodeResponse(token_ids=e.token_ids, rendered_chars=e.rendered_chars)


class TokenizerServicer:
    def __init__(self, tokenization: Tokenization):
        self.t = tokenization

    def _observe(self, method: str, request, handler):
        start = time.perf_counter()
        code = "OK"
        try:
            return handler(wire.parsed(request))
        except ServiceError as exc:
            code = exc.code.name
            raise
        except BaseException:
            code = "INTERNAL"
            raise
        finally:
            metrics.REQUESTS.labels(method, code).inc()
            metrics.LATENCY.labels(method).observe(time.perf_counter() - start)

    def _encode(self, model: str, inputs: list[EncodeInput], batch: bool) -> list[Encoded]:
        out = self.t.encode(model, inputs, batch=batch)
        metrics.TOKENS_ENCODED.labels(model).inc(sum(len(e.token_ids) for e in out))
        return out

    def Encode(self, request, context):
        def handle(req: pb.EncodeRequest):
            (out,) = self._encode(req.model, [_encode_input(req)], False)
            return _encoded_pb(out)
        return self._observe("Encode", request, handle)

    def EncodeBatch(self, request, context):
        def handle(req: pb.EncodeBatchRequest):
            _batch_model(req.model, req.requests)
            out = self._encode(req.model, [_encode_input(r) for r in req.requests], True)
            return pb.EncodeBatchResponse(results=[_encoded_pb(e) for e in out])
        return self._observe("EncodeBatch", request, handle)

    def CountTokens(self, request, context):
        def handle(req: pb.EncodeRequest):
            (out,) = self._encode(req.model, [_encode_input(req)], False)
            return pb.CountTokensResponse(count=len(out.token_ids))
        return self._observe("CountTokens", request, handle)

    def CountTokensBatch(self, request, context):
        def handle(req: pb.EncodeBatchRequest):
            _batch_model(req.model, req.requests)
            out = self._encode(req.model, [_encode_input(r) for r in req.requests], True)
            return pb.CountTokensBatchResponse(counts=[len(e.token_ids) for e in out])
        return self._observe("CountTokensBatch", request, handle)

    def _decode(self, model: str, inputs: list[DecodeInput], batch: bool) -> list[str]:
        out = self.t.decode(model, inputs, batch=batch)
        metrics.TOKENS_DECODED.labels(model).inc(sum(len(i.token_ids) for i in inputs))
        return out

    def Decode(self, request, context):
        def handle(req: pb.DecodeRequest):
            (text,) = self._decode(
                req.model, [DecodeInput(req.token_ids, req.skip_special_tokens)], False)
            return pb.DecodeResponse(text=text)
        return self._observe("Decode", request, handle)

    def DecodeBatch(self, request, context):
        def handle(req: pb.DecodeBatchRequest):
            _batch_model(req.model, req.requests)
            inputs = [DecodeInput(r.token_ids, r.skip_special_tokens) for r in req.requests]
            texts = self._decode(req.model, inputs, True)
            return pb.DecodeBatchResponse(results=[pb.DecodeResponse(text=t) for t in texts])
        return self._observe("DecodeBatch", request, handle)

    def GetTokenizerInfo(self, request, context):
        def handle(req: pb.GetTokenizerInfoRequest):
            info = self.t.info(req.model)
            return pb.GetTokenizerInfoResponse(
                model=info.model, vocab_size=info.vocab_size, bos_token_id=info.bos_token_id,
                eos_token_id=info.eos_token_id, special_token_ids=info.special_token_ids,
                has_chat_template=info.has_chat_template, max_text_bytes=info.max_text_bytes)
        return self._observe("GetTokenizerInfo", request, handle)
