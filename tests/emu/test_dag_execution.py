"""transition.local_dag nodes run one-to-one as emu primitives: state kept, bytes as priced."""

import pytest

from tests.emu import workers


@pytest.mark.parametrize("trains", [False, True])
def test_local_dag_nodes_execute_exactly(dist4, trains):
    per_rank = dist4.run(workers.run_local_dags, "gqa_tied", trains)
    for rank, cases in enumerate(per_rank):
        assert len(cases) == 6
        for current, target, rows, diff, reached in cases:
            assert rows, (current, target)
            assert diff == [], (current, target, diff[:3])
            assert reached, (rank, current, target)
            if not trains:  # the brain prices inference state exactly as the body moves it
                assert [brain for _, brain, _ in rows] == [body for _, _, body in rows], (
                    rank,
                    current,
                    target,
                    rows,
                )
