"""Per-key prefix-cache isolation (--cache-salt-per-api-key), seen by two tenants of one `kvmesh serve`:

a key that sends a prompt twice gets the second's prefix from the cache (`cached_tokens` > 0), but
another key sending the same prompt gets nothing cached, even with the same `cache_salt` of its own:
`cached_tokens` no longer tells one tenant what another sent. Without the flag keys share cached
prefixes (the default, which the docs say).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.services.procs import Serve, gateway_over

pytestmark = pytest.mark.slow

KEYS = ("sk-tenant-a", "sk-tenant-b")
# Long enough for several full KV blocks: only full blocks are cached.
PROMPT = ("The quarterly report of the secret project lists these figures: " + "seven, eleven, thirteen, " * 12)


@pytest.fixture(scope="module")
def serve(serve: Serve) -> Iterator[Serve]:
    with gateway_over(serve, [*(a for key in KEYS for a in ("--api-key", key)), "--cache-salt-per-api-key"]) as gateway:
        yield gateway


def cached_tokens(serve: Serve, key: str, prompt: str, **extra) -> int:
    client = openai.OpenAI(base_url=serve.api, api_key=key, timeout=120, max_retries=0)
    completion = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, extra_body=extra or None)
    details = completion.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_one_key_hits_its_own_cache_and_never_another_keys(serve: Serve):
    a, b = KEYS
    prompt = f"{PROMPT} (plain)"
    assert cached_tokens(serve, a, prompt) == 0
    assert cached_tokens(serve, a, prompt) > 0  # the cache works: the check below can fail
    assert cached_tokens(serve, b, prompt) == 0
    assert cached_tokens(serve, b, prompt) > 0


def test_a_clients_own_salt_does_not_join_another_keys_cache(serve: Serve):
    a, b = KEYS
    prompt = f"{PROMPT} (salted)"
    assert cached_tokens(serve, a, prompt, cache_salt="shared") == 0
    assert cached_tokens(serve, a, prompt, cache_salt="shared") > 0
    assert cached_tokens(serve, b, prompt, cache_salt="shared") == 0
    assert cached_tokens(serve, a, prompt, cache_salt="other") == 0  # the client's salt still counts
