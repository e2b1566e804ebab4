"""GetUsage: a tenant reads its own usage, as billed (the gateway's records in the meter).

The caller's tenant comes from its API key; the request may name that tenant or none.
"""
from __future__ import annotations

from services.gateway.auth import Caller
from tokenserve.gateway.v1 import gateway_pb2
from tokenserve.meter.v1 import meter_pb2
from tokenserve.runtime.errors import PermissionDenied


def tenant_usage_query(caller: Caller,
                       request: gateway_pb2.GetUsageRequest) -> meter_pb2.QueryUsageRequest:
    """The meter query for `request`, scoped to the caller's tenant; another tenant's id is
    PERMISSION_DENIED. The meter checks the window, groups and bucket."""
    if request.tenant_id and request.tenant_id != caller.tenant_id:
        raise PermissionDenied(
            f"tenant_id {request.tenant_id!r} is not this key's tenant; a key reads only its"
            f" own tenant's usage (leave tenant_id empty or set it to {caller.tenant_id!r})")
    return meter_pb2.QueryUsageRequest(
        tenant_id=caller.tenant_id, start=request.start, end=request.end,
        group_by=list(request.group_by), bucket_seconds=request.bucket_seconds,
        source=meter_pb2.SOURCE_GATEWAY)
