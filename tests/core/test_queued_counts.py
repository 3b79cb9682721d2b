"""The per-tenant queue counts hold only tenants with something queued: client-chosen ids come
and go without the maps growing."""

from __future__ import annotations

from tests.core.helpers import make_harness


def test_a_thousand_tenants_come_and_go_and_the_maps_end_empty() -> None:
    h = make_harness(max_num_seqs=4, max_queued_per_tenant=2)
    queued = h.scheduler._queued
    for i in range(1000):
        h.add(f"r{i}", [5, 6, 7, 8], max_tokens=2, tenant=f"tenant-{i}")
        if i % 7 == 0:  # some leave by abort while still queued
            h.scheduler.abort_requests([f"r{i}"])
        if i % 4 == 3:
            h.step()
            h.step()
        assert len(queued.by_tenant) <= 8
    h.run()
    assert queued.by_tenant == {} and queued.tenant_drain == {}
    assert set(queued.by_tier) == {1} and queued.by_tier[1] == 0


def test_a_tenant_keeps_its_count_while_anything_of_its_is_queued() -> None:
    h = make_harness(max_num_seqs=1, max_queued_per_tenant=3)
    for i in range(3):
        h.add(f"a{i}", [5, 6], max_tokens=4, tenant="a")
    h.step()  # one admitted, two queued
    assert h.scheduler._queued.by_tenant == {"a": 2}
    h.run()
    assert h.scheduler._queued.by_tenant == {}
