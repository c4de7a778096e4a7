"""A planner case of the fidelity harness that asks for a plan the search did not rank (its
pruning kept fewer candidates within reach of the best) is left out and named with its reason in
the report, instead of ending the whole run (the bench stopped at plan-tiny-1+1-top2 on 0967dbb)."""

from __future__ import annotations

import dataclasses

from medley.cost.profile_format import Profile
from medley.fidelity.cases import planned_cases
from medley.fidelity.fidelity_report import markdown_from_payload
from medley.fidelity.harness import profile_key, run_cases


def test_an_unranked_planner_case_is_skipped_and_said(profile: Profile) -> None:
    case = dataclasses.replace(planned_cases(top=1)[0], name="plan-tiny-1+1-top9", from_planner=9,
                               dtype="fp32")
    skipped: dict[str, str] = {}
    results = run_cases([case], {profile_key(case): (profile, "test")}, steps=2, refresh_layers=False,
                        skipped=skipped)
    assert results == []
    assert list(skipped) == ["plan-tiny-1+1-top9"]
    assert skipped["plan-tiny-1+1-top9"].startswith("the planner ranked only ")
    assert skipped["plan-tiny-1+1-top9"].endswith(" not 9")
    text = markdown_from_payload({"meta": {"skipped": skipped}, "results": []})
    assert f"Skipped plan-tiny-1+1-top9: {skipped['plan-tiny-1+1-top9']}." in text
