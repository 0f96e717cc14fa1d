"""The prompt cache's disk tier through `mlx-cluster serve`, as a user restarts it: a long
prompt answered once, serve stopped, started again, the same prompt and a new turn read most
of the prompt from each host's disk (every rank its own layers), with single-process mlx-lm's
text; a server of another plan (mode) on the same folder misses. The tier's parts (blocks,
checksums, the bound, two writers): tests/e2e/test_diskcache.py."""

import time

import pytest

from node.cache.disk import BLOCK_TOKENS
from tests.support.long_context import long_text
from tests.support.processes import rank_pids
from tests.support.reference import reference
from tests.support.serving import Served
from tests.support.tiny import make_model


@pytest.fixture(autouse=True)
def no_stray_ranks():
    yield
    assert rank_pids() == []


def complete(server, prompt: str, max_tokens: int = 12):
    return server.client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                            temperature=0)  # fmt: skip


def metric(server, name: str) -> str:
    import urllib.request

    url = f"http://127.0.0.1:{server.port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return [line for line in text.splitlines() if line.startswith(name)]


def test_serve_started_again_then_launch_and_chat_read_a_long_prefix_from_disk(tmp_path):
    """serve answers a 1,100-token prompt and stops; started again, it reads the prompt's
    blocks back for the same prompt plus a turn; launch and chat of the same plan (2 ranks,
    pipeline) read them too; a tensor-mode server on the same folder has its own blocks."""
    from tests.support.processes import run_cli

    model = make_model(tmp_path / "m", "llama", seed=1, max_position_embeddings=8192)
    folder = tmp_path / "disk"
    first = long_text(model, 1100)
    turn = first + " and then the next question about it"
    disk = ["--prompt-cache-disk-gb", "1", "--prompt-cache-dir", str(folder)]
    flags = ["-n", "2", *disk]
    served = Served(model, *flags, "--mode", "pipeline")
    try:
        cold = complete(served, first)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert served.stop() == 0  # the drain: the blocks are written before the ranks end
    assert len(list(folder.rglob("*.safetensors"))) == 2 * (1100 + 12 - 1) // BLOCK_TOKENS

    again = Served(model, *flags, "--mode", "pipeline")
    try:
        warm = complete(again, turn)
        assert warm.choices[0].text == reference(model, turn, 12)
        read = warm.usage.prompt_tokens_details.cached_tokens
        assert read == 4 * BLOCK_TOKENS, read  # the blocks the first prompt filled
        assert metric(again, 'mlx_cluster_prompt_cache_lookups_total{result="disk"}') == [
            'mlx_cluster_prompt_cache_lookups_total{result="disk"} 1.0'
        ]
        assert metric(again, 'mlx_cluster_prompt_cache_tokens_total{tier="disk"}') == [
            f'mlx_cluster_prompt_cache_tokens_total{{tier="disk"}} {float(read)}'
        ]
        deadline = time.monotonic() + 20  # each rank reports its bytes every 5 s
        while time.monotonic() < deadline:
            reads = [x for x in metric(again, "mlx_cluster_rank_disk_cache_bytes{")
                     if 'direction="read"' in x and float(x.split()[-1]) > 0]  # fmt: skip
            if len(reads) == 2:
                break
            time.sleep(0.5)
        assert len(reads) == 2, metric(again, "mlx_cluster_rank_disk_cache_bytes")
    finally:
        assert again.stop() == 0

    job = ["--model", model, "--max-tokens", 12, *disk]  # launch's default: 2 ranks, pipeline
    launched = run_cli("launch", *job, "-", input=turn)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == reference(model, turn, 12)
    assert f"cache {read} ({read} from disk)" in launched.stderr, launched.stderr
    chat = run_cli("chat", *job, input=first + "\n")  # the same plan: the same blocks
    assert chat.returncode == 0, chat.stderr
    assert "from disk)" in chat.stderr, chat.stderr

    other = Served(model, *flags, "--mode", "tensor")  # another plan: its own blocks
    try:
        miss = complete(other, turn)
        assert miss.usage.prompt_tokens_details.cached_tokens == 0
        assert miss.choices[0].text == reference(model, turn, 12)
    finally:
        assert other.stop() == 0
