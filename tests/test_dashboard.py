"""The dashboard page, its JSON endpoint, and the Jupyter repr (one summary for all three)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest
from distributed import Client, LocalCluster

from dask_ddict import DDict
from dask_ddict.cluster.scheduler_plugin import DDictSchedulerPlugin
from dask_ddict.display import dict_html, summarize
from dask_ddict.layout import Layout, ManagerInfo
from dask_ddict.options import DDictOptions
from dask_ddict.stats import DDictManagerStats
from tests.support.cluster import local_cluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _layout(name: str = "demo", n: int = 3) -> Layout:
    managers = tuple(
        ManagerInfo(
            manager_id=i,
            worker=f"tcp://10.0.0.{i}:1",
            hostname=f"host{i % 2}",
            host_id="h",
            pid=1,
            uds_path="",
            tcp_host="",
            tcp_port=0,
            store_path="",
            lost=i == 2,
        )
        for i in range(n)
    )
    return Layout(
        name=name,
        uid="u",
        secret="s3cret",
        tls=False,
        options=DDictOptions(),
        managers=managers,
        total_mem=3 << 20,
        lifetime="client",
    )


def _stats(mid: int, keys: int) -> DDictManagerStats:
    return DDictManagerStats(
        manager_id=mid,
        worker="w",
        hostname="h",
        total_bytes=1 << 20,
        total_used_bytes=keys * 100,
        pool_free_space=0,
        pool_utilization=keys * 100 / (1 << 20),
        num_keys=keys,
        oldest_checkpoint=2,
        newest_checkpoint=4,
    )


def test_summary_counts_answers_and_names_every_problem():
    s = summarize(
        _layout(),
        {0: _stats(0, 5), 1: ConnectionRefusedError("refused")},
        {0: [1, 3]},
        holders=["c1"],
        checkpoint=4,
    )
    assert (s["num_keys"], s["bytes"], s["answered"]) == (5, 500, 1)
    assert [m["error"] for m in s["managers"]] == [
        None,
        "ConnectionRefusedError: refused",
        "lost with its host",
    ]
    assert s["managers"][0]["window"] == [2, 4] and s["managers"][0]["persisted"] == [1, 3]
    assert s["hosts"] == ["host0", "host1"] and s["holders"] == ["c1"]
    assert json.loads(json.dumps(s)) == s  # JSON-ready as it is
    assert "s3cret" not in json.dumps(s)  # the secret never leaves the orchestrator
    html = dict_html(s)
    assert "5 keys," in html and '<td style="text-align: right;">5</td>' in html
    assert "[2, 4]" in html and "1, 3" in html and "refused" in html


def test_html_escapes_user_text():
    html = dict_html(summarize(_layout("<b>x</b>"), {}))
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html
    assert html.count("<tr") == 3 + 4  # three managers, four summary rows (and no persist row)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.read()


def _base(cluster: LocalCluster) -> str:
    return cluster.dashboard_link.rsplit("/", 1)[0]


def _wait_listed(cluster: LocalCluster, name: str) -> None:
    """Until the page's data (refreshed every ``ddict.dashboard.refresh``) lists ``name``."""
    for _ in range(100):
        if any(
            d["name"] == name for d in json.loads(_get(_base(cluster) + "/ddict.json"))["dicts"]
        ):
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} never listed")


def test_page_and_json_show_the_dicts_live(cluster, client, ddict):
    for i in range(10):
        ddict[i] = i
    _wait_listed(cluster, ddict.get_name())
    data = json.loads(_get(_base(cluster) + "/ddict.json"))
    (mine,) = [d for d in data["dicts"] if d["name"] == ddict.get_name()]
    assert mine["num_keys"] == 10 and mine["answered"] == 2
    assert mine["holders"] == [client.id] and mine["lifetime"] == "client"
    assert {m["worker"] for m in mine["managers"]} == set(ddict.manager_workers)
    assert all(m["capacity"] == 32 << 20 and m["error"] is None for m in mine["managers"])
    page = _get(_base(cluster) + "/ddict").decode()
    assert ddict.get_name() in page and "<script>" in page
    other = DDict(total_mem="32 MiB", client=client, name="appears-later")
    try:
        _wait_listed(cluster, "appears-later")  # within ddict.dashboard.refresh (2 s)
        fragment = _get(_base(cluster) + "/ddict?fragment=1").decode()
        assert 'data-ddict="appears-later"' in fragment and "<html" not in fragment
    finally:
        other.destroy()
    status = _get(_base(cluster) + "/status").decode()  # bokeh's navigation links to the page
    assert 'href="ddict"' in status


def test_the_routes_are_in_the_sitemap():
    # Without bokeh's dashboard: with bokeh 3.9, distributed's own /sitemap.json fails
    # (KeyError 'path' on bokeh's static handler), with or without dask_ddict.
    with (
        local_cluster(
            0, dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": False}
        ) as cl,
        Client(cl) as c,
    ):
        c.register_plugin(DDictSchedulerPlugin())
        paths = json.loads(_get(_base(cl) + "/sitemap.json"))["paths"]
        assert {"/ddict", "/ddict.json"} <= set(paths)
        assert json.loads(_get(_base(cl) + "/ddict.json")) == {"dicts": []}


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs a headless Chromium (.ci/run installs Debian's chromium package)",
)
def test_the_page_in_a_real_browser(cluster, client, ddict, tmp_path):
    ddict["shown"] = "in the browser"
    url = _base(cluster) + "/ddict"
    _wait_listed(cluster, ddict.get_name())  # past the page's refresh interval
    common = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run(
        [*common, "--virtual-time-budget=6000", "--dump-dom", url],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert f'data-ddict="{ddict.get_name()}"' in dom
    assert 'data-refreshes="' in dom  # the live update ran, in the browser, and swapped content
    shot = tmp_path / "dashboard.png"
    subprocess.run(
        [*common, "--window-size=1200,560", f"--screenshot={shot}", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    if os.environ.get("DDICT_DOCS_SCREENSHOT"):  # docs/_static/dashboard.png comes from here
        shutil.copy(shot, os.environ["DDICT_DOCS_SCREENSHOT"])


def test_jupyter_repr(ddict):
    assert repr(ddict) == (
        f"<DDict {ddict.get_name()!r} managers=2 hosts=1 total_mem=64.00 MiB checkpoint=0>"
    )
    assert "secret" not in repr(ddict._core.layout)
    ddict["k"] = "v"
    html = ddict._repr_html_()
    assert ddict.get_name() in html and "checkpoint 0" in html
    assert 'class="ddict-problem"' not in html and "1 key," in html
    for worker in ddict.manager_workers:
        assert worker in html
