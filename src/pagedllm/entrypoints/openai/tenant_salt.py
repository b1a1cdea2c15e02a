"""--cache-salt-from-api-key: each request's cache_salt derived from the caller's API key, so that tenants never
share prefix-cache blocks."""

from __future__ import annotations

import hashlib
import hmac

from pagedllm.engine.input_processor import InvalidRequestError, check_cache_salt
from pagedllm.entrypoints.openai import errors


def tenant_cache_salt(secret: bytes, api_key: str, client_salt: str | None) -> str:
    """The cache_salt of a request under --cache-salt-from-api-key: HMAC-SHA256(secret, key, client salt).

    Two tenants (keys) never get the same salt, whatever salts their clients send; one tenant's requests
    share cache when their client salts are equal (or both absent).

    Raises APIError (400) for a client salt the engine would refuse (the hash would hide it)."""
    try:
        check_cache_salt(client_salt)
    except InvalidRequestError as e:
        raise errors.to_api_error(e) from None
    message = api_key.encode() + b"\0" + (b"" if client_salt is None else b"\1" + client_salt.encode())
    return hmac.new(secret, message, hashlib.sha256).hexdigest()
