"""A vLLM request's tenant: its ``cache_salt``, carried on the request's ``ReqContext``.

vLLM folds a request's ``cache_salt`` into its block hashes (tenants never share a prefix), but it
hands an offloading manager only a ``ReqContext`` (request id, ``kv_transfer_params``, hints),
never the ``Request`` and so never the salt. The tenant therefore reaches tieredkv one of two ways:

* ``TieredKVConnector`` sees the ``Request``: when vLLM adds it, the connector stores
  :class:`RequestTenant` of ``request.cache_salt`` in the context's per-request state
  (``ReqContext.set_state``) — the same context object every manager hook and every secondary
  tier's ``TransferJob`` gets for that request;
* otherwise (vLLM's own ``OffloadingConnector``), ``kv_transfer_params["cache_salt"]`` if the
  request carries one there; else the default tenant (no quota).

:func:`request_tenant` reads it (once per request; then a dict read), as a tenant id
(:func:`tieredkv.keys.tenant_id`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tieredkv.keys import tenant_id

__all__ = ["RequestTenant", "request_tenant", "set_request_tenant"]


class RequestTenant(NamedTuple):
    """A request's tenant, as ``ReqContext`` state: its id (0: the default tenant)."""

    id: int


_DEFAULT = RequestTenant(0)


def set_request_tenant(ctx: Any, cache_salt: str | bytes | None) -> int:
    """Record ``cache_salt`` as the tenant of the request of ``ctx`` (a ``ReqContext``); its id."""
    tenant = RequestTenant(tenant_id(cache_salt)) if cache_salt else _DEFAULT
    ctx.set_state(tenant)
    return tenant.id


def request_tenant(ctx: Any) -> int:
    """The tenant id of the request of ``ctx`` (a ``ReqContext``): what ``TieredKVConnector``
    recorded, else ``kv_transfer_params["cache_salt"]``, else 0 (the default tenant)."""
    tenant = ctx.get_state(RequestTenant)
    if tenant is None:
        params = ctx.kv_transfer_params
        salt = params.get("cache_salt") if params else None
        return set_request_tenant(ctx, salt if isinstance(salt, (str, bytes)) else None)
    return int(tenant.id)
