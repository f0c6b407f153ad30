"""requirements.txt pins the triton that its pinned torch's Linux wheels require, under the same
marker, so pip can satisfy both on a Linux GPU node and skips triton where torch does (macOS,
Windows)."""
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements.txt"

# torch version -> (triton version, marker): the triton Requires-Dist line in the METADATA of PyPI's
# torch wheels, read 2026-11-25 (2.13.0: cp312 manylinux_2_28 x86_64 and aarch64, macosx_14_0_arm64,
# win_amd64, all the same line; 2.11.0 and 2.12.0: cp312 manylinux_2_28 x86_64).
TORCH_TRITON = {
    "2.11.0": ("3.6.0", 'platform_system == "Linux"'),
    "2.12.0": ("3.7.0", 'platform_system == "Linux"'),
    "2.13.0": ("3.7.1", 'platform_system == "Linux" and python_version < "3.15"'),
}

ENVIRONMENTS = {
    "linux": {"platform_system": "Linux", "sys_platform": "linux", "python_version": "3.12"},
    "macos": {"platform_system": "Darwin", "sys_platform": "darwin", "python_version": "3.12"},
    "windows": {"platform_system": "Windows", "sys_platform": "win32", "python_version": "3.12"},
}


def requirements(text):
    """{name: Requirement} for each requirement line, comments and blank lines skipped."""
    reqs = [
        Requirement(line.split("#")[0]) for line in text.splitlines() if line.split("#")[0].strip()
    ]
    return {r.name.lower(): r for r in reqs}


def pinned_version(req):
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req.name} should be pinned with ==, not {req}"
    return spec.version


def triton_pin_problem(text):
    """None when the triton line matches the table's entry for the pinned torch, else what to
    fix."""
    reqs = requirements(text)
    torch_version = pinned_version(reqs["torch"])
    if torch_version not in TORCH_TRITON:
        return (
            f"torch {torch_version} is not in TORCH_TRITON: add the triton requirement of torch "
            f"{torch_version}'s Linux wheel to the table, read from its METADATA"
        )
    triton_version, marker = TORCH_TRITON[torch_version]
    want = f"triton=={triton_version}; {marker}"
    got = reqs.get("triton")
    if (
        got is None
        or str(got.specifier) != f"=={triton_version}"
        or str(got.marker) != str(Marker(marker))
    ):
        return (
            f"torch {torch_version}'s Linux wheel requires `{want}`; requirements.txt has `{got}`"
        )
    return None


def test_triton_pin_matches_pinned_torch():
    problem = triton_pin_problem(REQUIREMENTS.read_text())
    assert problem is None, problem


@pytest.mark.parametrize("env, required", [("linux", True), ("macos", False), ("windows", False)])
def test_triton_required_on_linux_only(env, required):
    triton = requirements(REQUIREMENTS.read_text())["triton"]
    assert triton.marker is not None and triton.marker.evaluate(ENVIRONMENTS[env]) == required


def test_torch_bump_without_table_entry_fails():
    text = REQUIREMENTS.read_text()
    bumped = text.replace(f"torch=={pinned_version(requirements(text)['torch'])}", "torch==9.9.0")
    missing = "add the triton requirement of torch 9.9.0's Linux wheel to the table"
    assert f"{missing}, read from its METADATA" in triton_pin_problem(bumped)


def test_torch_bump_with_stale_triton_fails():
    problem = triton_pin_problem('torch==2.13.0\ntriton==3.7.0; platform_system == "Linux"\n')
    assert (
        'requires `triton==3.7.1; platform_system == "Linux" and python_version < "3.15"`'
        in problem
    )


@pytest.mark.parametrize("line", ["triton==3.7.1", 'triton==3.7.1; platform_system == "Linux"', ""])
def test_triton_without_torchs_marker_or_missing_fails(line):
    assert triton_pin_problem(f"torch==2.13.0\n{line}\n") is not None
