"""/v1/cluster (serve's overview for its page and `mlx-cluster status`) from serve's own state,
without ranks; the page's files load without the key while its data needs it. (The page in a
real browser against a real serve: tests/e2e/test_page.py.)"""

from __future__ import annotations

import http.client
import json

import pytest

from cluster.commands.status import render
from cluster.core.protocol import LinkReport, Memory, Ready, Stats
from cluster.job.state import on_event
from cluster.serve.http import PAGE_FILES, Api
from cluster.serve.overview import BUCKET_S, WINDOW_S, percentiles, rates
from cluster.serve.service import Answered
from tests.support.serving import StandIn, request, service, start_job, wait_sent


def test_the_overview_has_every_host_rank_request_and_figure():
    svc, sent = service()
    start_job(svc, sent)
    for rank, event in ((0, Ready(1.5, layers=[3, 6])), (1, Ready(1.2, layers=[0, 3])),
                        (1, Memory(2.5))):  # fmt: skip
        on_event(svc.state, rank, event, 1.0)  # what the launcher does with each event
    req = request(False)
    svc.submit(req)
    wait_sent(sent, 1)
    timings = {"prompt_n": 100, "prompt_ms": 500.0, "predicted_n": 20, "predicted_ms": 400.0}
    usage = {"prompt_tokens": 100, "completion_tokens": 20}
    svc.on_event(0, Stats("stop", usage, timings, 0.6, request=req.id))
    c = svc.cluster()
    assert (c["status"], c["mode"], c["ranks"], c["in_flight"], c["answered"]) == (
        "ok", "pipeline", 2, 0, 1)  # fmt: skip
    names = [h["name"] for h in c["hosts"]]
    assert names == ["a.local", "b.local", "c.local"]  # the hostfile's hosts, in order
    a, b, idle = c["hosts"]
    assert [r["rank"] for r in a["ranks"]] == [0] and a["ranks"][0]["layers"] == [3, 6]
    assert b["ranks"][0]["peak_memory_gb"] == 2.5 and not idle["ranks"]
    assert not any(h["left_out"] for h in c["hosts"])
    assert c["ttft_s"] == {"p50": 0.6, "p95": 0.6}
    assert len(c["rates"]) == WINDOW_S // BUCKET_S
    assert c["rates"][-1]["prefill_tps"] == 100 / BUCKET_S  # the answer ended just now
    json.dumps(c)  # plain JSON
    text = render(c)
    assert text.splitlines()[0] == "m: ok, pipeline mode, 2 of 2 ranks up, 0 restart(s)"
    assert "layers 3-5" in text and "layers 0-2" in text and "2.50 GB" in text


def test_the_links_the_ranks_measured_show_with_the_slow_one_marked():
    """Rank 0's LinkReport (serve --measure-links) names each link by its ranks' hosts; a link
    doctor would name is marked slow, with doctor's words; a restart forgets the old ranks'."""
    svc, sent = service()
    start_job(svc, sent)
    assert svc.cluster()["links"] is None  # not measured yet
    row = {"rtt_4b_us": 60.0, "rtt_4b_max_us": 90.0, "rtt_8kb_us": 80.0, "rtt_8kb_max_us": 120.0,
           "bad_words": 0.0}  # fmt: skip
    fast, slow = {"a": 0, "b": 1, **row, "gbps": 40.0}, {"a": 1, "b": 0, **row, "gbps": 4.0}
    svc.on_event(0, LinkReport([fast, slow], 70.0, 95.0, 0.0))
    links = svc.cluster()["links"]
    assert [(x["hosts"], x["slow"], x["exact"]) for x in links["links"]] == [
        (["a.local", "b.local"], False, True), (["b.local", "a.local"], True, True)]  # fmt: skip
    (problem,) = links["problems"]
    assert "rank 1 (b.local) - rank 0 (a.local): 4.00 Gbit/s, under a third" in problem
    assert links["allsum_4b_us"] == 70.0 and links["allsum_exact"]
    text = render(svc.cluster())
    assert "a.local - b.local" in text and "40.00 Gbit/s  yes\n" in text
    assert "4.00 Gbit/s  yes  SLOW" in text and problem in text
    svc.job_ended(None)
    assert svc.cluster()["links"] is None


def test_every_rank_gets_the_choice_to_measure_links():
    """--no-measure-links reaches every rank (the serve settings reach rank 0 only): a rank
    that measured alone would wait for its peers forever."""
    from cluster.core.spec import JobSpec

    spec = JobSpec(model="m", command="serve", world_size=2, measure_links=False)
    assert not spec.for_rank(1).measure_links and not spec.for_rank(0).measure_links


def test_rates_count_each_answer_in_the_bucket_it_ended_in():
    now = 1000.0
    answers = [Answered(now - 5, 50, 1.0, 10, 1.0, 0.2), Answered(now - 15, 30, 1.0, 6, 1.0, 1.0),
               Answered(now - WINDOW_S - 1, 999, 1.0, 999, 1.0, 9.0)]  # fmt: skip
    got = rates(answers, now)
    assert got[-1] == {"ago_s": BUCKET_S, "prefill_tps": 5.0, "decode_tps": 1.0}
    assert got[-2] == {"ago_s": 2 * BUCKET_S, "prefill_tps": 3.0, "decode_tps": 0.6}
    assert sum(b["prefill_tps"] for b in got) == 8.0  # the old one is out of the window
    assert percentiles([]) == {"p50": None, "p95": None}
    p = percentiles([float(i) for i in range(1, 101)])
    assert p["p50"] == 50.5 and 95 <= p["p95"] <= 96


@pytest.fixture
def keyed():
    service = StandIn()
    service.cluster = lambda: {"status": "ok"}
    server = Api("127.0.0.1", 0, "sekrit", service)
    server.start()
    yield server
    server.stop()


def get(api, path: str, key: str | None = None):
    conn = http.client.HTTPConnection(*api.address, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    r = conn.getresponse()
    return r.status, r.getheader("Content-Type"), r.read()


def test_the_page_loads_without_the_key_and_its_data_needs_it(keyed):
    status, kind, body = get(keyed, "/")
    assert status == 200 and kind.startswith("text/html") and b"/page/page.js" in body
    for name, kind in PAGE_FILES.items():
        assert get(keyed, f"/page/{name}")[:2] == (200, kind)
    assert get(keyed, "/page/../http.py")[0] == 404  # only the page's own files
    assert get(keyed, "/v1/cluster")[0] == 401
    status, _, body = get(keyed, "/v1/cluster", "sekrit")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert get(keyed, "/health")[0] == 401
    page = b"".join(get(keyed, f"/page/{n}")[2] for n in PAGE_FILES)
    assert b"http://" not in page.replace(b"http://www.w3.org/2000/svg", b"")  # no CDN
    assert b"https://" not in page


def test_handoffs_count_only_the_answers_a_prefill_group_prefilled():
    from cluster.core.protocol import Stats
    from cluster.serve.overview import handoffs

    def stats(timings):
        return Stats("stop", {}, timings, 0.5, "r")

    handed = {"prompt_n": 9000, "prompt_ms": 10.0, "predicted_n": 4, "predicted_ms": 40.0,
              "handoff_n": 8999, "handoff_bytes": 110_000_000, "handoff_ms": 2000.0}  # fmt: skip
    other = {**handed, "handoff_ms": 4000.0, "handoff_bytes": 90_000_000}
    answers = [Answered.of(stats(t), 0.0) for t in (handed, other, {"prompt_n": 5})]
    assert handoffs(answers) == {"count": 2, "bytes": 200_000_000, "p50_s": 3.0}
    assert handoffs(answers[2:]) == {"count": 0, "bytes": 0, "p50_s": None}
