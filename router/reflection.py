"""gRPC server reflection under both of its names: ``grpc.reflection.v1``, which current clients
(grpcurl, grpcui, Postman) ask first, and ``grpc.reflection.v1alpha``, which older ones ask.

grpcio-reflection ships only v1alpha. v1 is the same protocol with the same messages under a
new package name, so the two are identical on the wire: v1 is served here by grpcio-reflection's
own servicer, its messages read and written with the v1alpha classes. The v1 file descriptor
(v1alpha's, renamed) goes into the descriptor pool, so that a client reflecting on the
reflection service itself finds either name.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

ALPHA = reflection_pb2.DESCRIPTOR.package  # grpc.reflection.v1alpha
V1 = "grpc.reflection.v1"
V1_SERVICE = f"{V1}.ServerReflection"
SERVICE_NAMES = (reflection.SERVICE_NAME, V1_SERVICE)


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto, renamed to v1 (package and every type reference in it)."""
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = V1
    fdp.ClearField("options")  # v1alpha's language packages; none is needed to describe v1

    def rename(type_name: str) -> str:
        return type_name.replace(f".{ALPHA}.", f".{V1}.", 1)

    for message in fdp.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = rename(field.type_name)
    for service in fdp.service:
        for method in service.method:
            method.input_type, method.output_type = rename(method.input_type), rename(method.output_type)
    return fdp


def _register_v1(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindServiceByName(V1_SERVICE)
    except KeyError:
        pool.AddSerializedFile(_v1_file().SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection on ``server`` under both names, listing ``service_names`` and itself."""
    pool = descriptor_pool.Default()
    _register_v1(pool)
    servicer = reflection.aio.ReflectionServicer((*service_names, *SERVICE_NAMES), pool=pool)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    handlers = [
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": info}) for name in SERVICE_NAMES
    ]
    server.add_generic_rpc_handlers(handlers)
