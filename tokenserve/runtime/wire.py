"""Request parsing that turns undecodable bytes into a precise INVALID_ARGUMENT.

protobuf rejects a proto3 `string` field holding invalid UTF-8 while parsing; inside grpc that
happens before any handler runs, and the caller would see INTERNAL "Exception deserializing
request!" (UNKNOWN on grpc.aio). The deserializers here catch the failure and hand the servicer
a `BadRequest` that names the field (`chat.messages[1].content`) and the byte offset, by
walking the wire format against the message descriptor; `parsed(request)` in the handler turns
it into InvalidArgument.

    add_servicer(servicer, server, tokenizer_pb2, "TokenizerService")  # instead of the
    # generated add_TokenizerServiceServicer_to_server
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, TypeVar

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from tokenserve.runtime.errors import InvalidArgument

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class BadRequest:
    """Stands in for a request that could not be parsed; `reason` is caller-facing."""

    reason: str


def parsed(request: M | BadRequest) -> M:
    """The request; InvalidArgument (naming the field) when it could not be parsed."""
    if isinstance(request, BadRequest):
        raise InvalidArgument(request.reason)
    return request


def add_servicer(servicer, server, pb_module: ModuleType, service: str) -> None:
    """Like the generated `add_<service>Servicer_to_server` (unary and server-streaming
    methods, sync or grpc.aio server), but every request goes through `lenient`: handlers
    get a `BadRequest` for undecodable bytes and call `parsed` on it."""
    desc = pb_module.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for m in desc.methods:
        if m.client_streaming:
            raise ValueError(f"{service}.{m.name}: client streaming is not supported")
        make = (grpc.unary_stream_rpc_method_handler if m.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[m.name] = make(
            getattr(servicer, m.name),
            request_deserializer=lenient(getattr(pb_module, m.input_type.name)),
            response_serializer=getattr(pb_module, m.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(desc.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(desc.full_name, handlers)


def lenient(message_type: type[Message]) -> Callable[[bytes], Message | BadRequest]:
    def deserialize(data: bytes) -> Message | BadRequest:
        try:
            return message_type.FromString(data)
        except DecodeError:
            return BadRequest(describe_decode_error(data, message_type.DESCRIPTOR))
    return deserialize


def describe_decode_error(data: bytes, descriptor: Descriptor) -> str:
    # Must never raise: an exception here reaches the caller as UNKNOWN.
    try:
        found = _find_bad_utf8(memoryview(data), descriptor, "")
    except Exception:  # noqa: BLE001
        found = None
    if found is not None:
        field, offset = found
        return (f"{field} is not valid UTF-8 (bad byte at offset {offset} of the field): "
                "string fields must be UTF-8 text")
    return f"the request is not a valid {descriptor.full_name} message"


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _find_bad_utf8(buf: memoryview, descriptor: Descriptor, prefix: str) -> tuple[str, int] | None:
    """(field path, offset) of the first string field that is not UTF-8, or None."""
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(buf):
            key, pos = _varint(buf, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(buf, pos)
                continue
            if wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                continue
            if wire_type != 2:
                return None
            length, pos = _varint(buf, pos)
            chunk, pos = buf[pos:pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if field.is_repeated:
                index = counts.get(number, 0)
                counts[number] = index + 1
                name = f"{name}[{index}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    bytes(chunk).decode("utf-8")
                except UnicodeDecodeError as exc:
                    return name, exc.start
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _find_bad_utf8(chunk, field.message_type, name + ".")
                if found is not None:
                    return found
    except (ValueError, IndexError):
        return None
    return None
