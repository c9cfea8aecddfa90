"""remote.pep440 / remote.pep508 against the reference implementation, ``packaging``."""

from __future__ import annotations

import itertools
import random

import pytest
from packaging.markers import InvalidMarker as PInvalidMarker
from packaging.markers import Marker as PMarker
from packaging.requirements import InvalidRequirement as PInvalidRequirement
from packaging.requirements import Requirement as PRequirement
from packaging.specifiers import InvalidSpecifier as PInvalidSpecifier
from packaging.specifiers import Specifier as PSpecifier
from packaging.specifiers import SpecifierSet as PSpecifierSet
from packaging.utils import canonicalize_name as p_canonicalize_name
from packaging.version import InvalidVersion as PInvalidVersion
from packaging.version import Version as PVersion

from remote import pep440, pep508

VERSIONS = [
    "0", "0.0", "1", "1.0", "1.0.0", "1.0.0.0", "1.0.1", "1.1", "1.2", "1.2.3", "1.10", "2", "2.0", "2.11.0",
    "2.11.0+cu128", "2.11.0+cu128.1", "2.11.0+cpu", "2.11.0+1", "2.11.0+abc.5", "2.11.0+5.abc", "3.6.0",
    "3.7.0", "3.6.0rc1", "3.6.0a1", "3.6.0b2", "3.6.0.dev0", "3.6.0rc1.dev1", "3.6.0.post1", "3.6.0-1",
    "3.6.0.post1.dev2", "3.6.0a1.post1", "1!1.0", "1!2.0.post1", "v1.0", "1.0-r4", "1.0rev5", "1.0c1",
    "1.0pre2", "1.0preview3", "1.0alpha", "1.0beta.1", "1.0.RC1", "1.0-dev", "1.0_post_3", "0.6.0",
    "2024.10.1", "1.0a0", "1.0a", "1.0.dev", "1.0+ubuntu-1", "1.0+UBUNTU_1", " 1.0 ", "1.0.post",
]
BAD_VERSIONS = ["", "1.", ".1", "1..0", "1.0+", "1.0+_x", "a1", "1.0-", "1.0a1b2", "1 0", "foo", "1.0+x y"]


@pytest.mark.parametrize("text", VERSIONS)
def test_version_normal_form_and_properties(text: str) -> None:
    mine, ref = pep440.Version(text), PVersion(text)
    assert str(mine) == str(ref)
    assert mine.public == ref.public
    assert mine.base_version == ref.base_version
    assert mine.is_prerelease == ref.is_prerelease
    assert mine.is_postrelease == ref.is_postrelease


@pytest.mark.parametrize("text", BAD_VERSIONS)
def test_bad_versions_rejected_like_packaging(text: str) -> None:
    with pytest.raises(PInvalidVersion):
        PVersion(text)
    with pytest.raises(pep440.InvalidVersion):
        pep440.Version(text)


def test_version_ordering_matches_packaging() -> None:
    pairs = list(itertools.product(VERSIONS, VERSIONS))
    for a, b in pairs:
        ma, mb, ra, rb = pep440.Version(a), pep440.Version(b), PVersion(a), PVersion(b)
        assert (ma < mb, ma == mb, ma > mb) == (ra < rb, ra == rb, ra > rb), (a, b)
        if ma == mb:
            assert hash(ma) == hash(mb)


SPEC_VERSIONS = ["1", "1.0", "1.2", "1.2.3", "2.11.0", "3.6.0", "3.6", "3.6.0rc1", "3.6.0.post1", "3.6.0.dev1",
                 "1!1.0", "2.11.0+cu128", "3.6.*", "3.*", "1.2.3.*", "1!1.*", "3.6.0a1", "0.6.0"]
OPERATORS = ["==", "!=", "<=", ">=", "<", ">", "~=", "==="]


def _spec_cases() -> list[str]:
    out = []
    for op, v in itertools.product(OPERATORS, SPEC_VERSIONS):
        out.append(f"{op}{v}")
    out += [" == 1.0 ", "==1.0.*", ">=1.0 ", "~=1", "~=1.*", "<1.0+local", ">=1.*", "==", "=1.0", "=>1.0",
            "===foo", "=== 1.0", "==1.0.post1.*", "==v1.0", "~=2.2.post3", "~=1.4.5a4", "<=1.0.dev1"]
    return out


@pytest.mark.parametrize("spec", _spec_cases())
def test_specifier_validity_and_containment(spec: str) -> None:
    try:
        ref = PSpecifier(spec)
    except PInvalidSpecifier:
        with pytest.raises(pep440.InvalidSpecifier):
            pep440.Specifier(spec)
        return
    mine = pep440.Specifier(spec)
    assert str(mine) == str(ref)
    for v in VERSIONS + ["foo", "1.0-foo"]:
        assert mine.contains(v) == ref.contains(v, prereleases=True), (spec, v)


def test_specifier_random_sets_against_packaging() -> None:
    rng = random.Random(440)
    specs = [s for s in _spec_cases() if _valid_spec(s) and "===" not in s]
    for _ in range(1500):
        clauses = rng.sample(specs, rng.randint(1, 3))
        text = ", ".join(clauses)
        mine, ref = pep440.SpecifierSet(text), PSpecifierSet(text)
        v = rng.choice(VERSIONS)
        assert mine.contains(v) == ref.contains(v, prereleases=True), (text, v)


def _valid_spec(s: str) -> bool:
    try:
        PSpecifier(s)
        return True
    except PInvalidSpecifier:
        return False


@pytest.mark.parametrize("name", ["Foo", "foo_bar", "Foo.Bar-baz", "A__B", "torch", "flash-linear-attention",
                                  "Flash_Linear.Attention", "x-_-y"])
def test_canonicalize_name(name: str) -> None:
    assert pep440.canonicalize_name(name) == p_canonicalize_name(name)


REQUIREMENTS = [
    "torch==2.11.0", "triton>=3.6", "flash-linear-attention==0.6.0", "A", "A.B-C_D", "aa", "name",
    "name<=1", "name>=3", "name>=3,<2", "name@http://foo.com", "name [fred,bar] @ http://foo.com ; python_version=='2.7'",
    "name[quux, strange];python_version<'2.7' and platform_version=='2'", "name; os_name=='a' or os_name=='b'",
    "name; os_name=='a' and os_name=='b' or os_name=='c'", "name; os_name=='a' and (os_name=='b' or os_name=='c')",
    "name; os_name=='a' or os_name=='b' and os_name=='c'", "name; (os_name=='a' or os_name=='b') and os_name=='c'",
    "name (>=1.0, <2.0)", "name (==1.*)", "torch[opt]==2.11.0 ; extra == 'GPU_x'", "foo ; extra == \"test\"",
    "triton==3.6.0; platform_system == \"Linux\" and platform_machine == \"x86_64\"",
    "numpy>=1.22; python_version >= '3.8'", "x; python_version in '3.8 3.9 3.10 3.11'",
    "x; 'linux' in sys_platform", "x; sys.platform == 'linux'", "x; python_implementation == 'CPython'",
    "x; os.name == 'posix'", "x; python_full_version ~= '3.11.0'", "x; python_version > '3.10'",
    "x; python_version == '3.11.*'", "x; python_version < 'abc'", "x; implementation_name not in 'pypy'",
    "x; extra=='a' or extra=='b'", "x (>=1)", "x >= 1 , < 2",
    # invalid
    "", "==1.0", "name==", "name=1.0", "name>=1.*", "name<1.0+local", "name[", "name[fred", "name[a b]",
    "name; os_name", "name; os_name=='a' and", "name; foo=='a'", "name (>=1.0", "name >=1.0)", "-name",
    "name; (os_name=='a'", "name@", "name @ http://x;python_version>'3'", "name @ http://x ;python_version>'3'",
    "name ; python_version ~= 'x'", "name; os_name not 'a'",
]


@pytest.mark.parametrize("text", REQUIREMENTS)
def test_requirement_parse_and_markers(text: str) -> None:
    try:
        ref = PRequirement(text)
    except PInvalidRequirement:
        with pytest.raises(pep508.InvalidRequirement):
            pep508.Requirement(text)
        return
    mine = pep508.Requirement(text)
    assert mine.name == ref.name
    assert mine.key == p_canonicalize_name(ref.name)
    assert mine.extras == ref.extras
    assert str(mine.specifier) == str(ref.specifier)
    assert mine.url == ref.url
    assert (mine.marker is None) == (ref.marker is None)
    if ref.marker is not None:
        for env in _environments():
            try:
                expected = ref.marker.evaluate(env)
            except Exception:  # noqa: BLE001 - an undefined comparison must fail in both
                with pytest.raises(pep508.InvalidMarker):
                    mine.marker.evaluate(env)  # type: ignore[union-attr]
                continue
            assert mine.marker.evaluate(env) == expected, (text, env)  # type: ignore[union-attr]


def _environments() -> list[dict[str, str]]:
    envs: list[dict[str, str]] = [{}]
    for py in ["2.7", "3.8", "3.10", "3.11", "3.12"]:
        envs.append({"python_version": py, "python_full_version": py + ".4"})
    envs += [{"extra": "test"}, {"extra": "GPU.x"}, {"extra": "a"}, {"os_name": "b"}, {"os_name": "a"},
             {"sys_platform": "win32", "platform_system": "Windows"}, {"platform_python_implementation": "PyPy"},
             {"implementation_name": "pypy"}, {"platform_version": "2"}]
    return envs


@pytest.mark.parametrize("text", [
    "python_version >= '3.8'", "extra == 'Foo_Bar'", "'3.8' <= python_version", "os_name == 'posix' and (",
    "python_version", "python_version ~= '3.1.*'", "'a' == 'a'", "platform_release >= '5.0'",
    "python_version === '3.11'", "sys_platform < 'x'",
])
def test_marker_standalone(text: str) -> None:
    try:
        ref = PMarker(text)
    except PInvalidMarker:
        with pytest.raises(pep508.InvalidMarker):
            pep508.Marker(text)
        return
    mine = pep508.Marker(text)
    for env in _environments() + [{"extra": "foo-bar"}]:
        try:
            expected = ref.evaluate(env)
        except Exception:  # noqa: BLE001
            with pytest.raises(pep508.InvalidMarker):
                mine.evaluate(env)
            continue
        assert mine.evaluate(env) == expected, (text, env)


def test_pep440_reexports_pep508_names() -> None:
    assert pep440.Requirement is pep508.Requirement
    assert pep440.SpecifierSet("==1.0").exact_version() == "1.0"
    assert pep440.SpecifierSet(">=1.0").exact_version() is None


# --------------------------------------------------------------------------- remote.pkgcheck's logic


class _FakeDist:
    def __init__(self, name: str, version: str, requires: list[str]) -> None:
        self.metadata = {"Name": name}
        self.version = version
        self.requires = requires


def _dists(*specs: tuple[str, str, list[str]]) -> dict:
    from remote import pkgcheck

    out = {}
    for name, version, requires in specs:
        d = pkgcheck.Dist(_FakeDist(name, version, requires))
        out[d.key] = d
    return out


def test_pkgcheck_names_the_broken_pin_and_the_missing_requirement() -> None:
    from remote import pkgcheck

    dists = _dists(("Fake_Torch", "2.11.0", ["fake.triton==3.6.0", "filelock", "nvidia-x; sys_platform == 'win32'"]),
                   ("fake-triton", "3.7.0", []))
    problems = pkgcheck.check_consistency(dists, {})
    assert [p["message"] for p in problems] == [
        "Fake_Torch 2.11.0 requires fake.triton==3.6.0; fake-triton is 3.7.0",
        "Fake_Torch 2.11.0 requires filelock, which is not installed",
    ]
    assert problems[0]["package"] == "fake-triton" and problems[0]["required_by"] == "fake-torch"
    assert problems[0]["kind"] == "requirement" and problems[1]["kind"] == "missing"


def test_pkgcheck_evaluates_requirements_of_requested_extras_transitively() -> None:
    from remote import pkgcheck

    dists = _dists(("a", "1.0", ["b[gpu]>=1"]), ("b", "1.0", ["c==2; extra == 'gpu'", "d==1; extra == 'other'"]),
                   ("c", "1.0", []))
    extras = pkgcheck.requested_extras(["a"], dists)
    assert extras["b"] == {"gpu"}
    assert [p["message"] for p in pkgcheck.check_consistency(dists, extras)] == ["b 1.0 requires c==2; c is 1.0"]
    assert pkgcheck.check_consistency(dists, {}) == []  # nobody asked for b[gpu]: its extra does not apply


def test_pkgcheck_override_turns_only_a_matching_break_into_a_warning() -> None:
    from remote import pkgcheck

    dists = _dists(("torch", "2.11.0", ["triton==3.6.0"]), ("triton", "3.7.0", []))
    problems = pkgcheck.check_pins(["triton==3.6.0"], dists) + pkgcheck.check_consistency(dists, {})
    kept, warned = pkgcheck.apply_overrides(problems, [{"package": "triton==3.7.0", "reason": "sm_120 fixes"}])
    assert kept == [] and len(warned) == 2
    assert all(w["reason"] == "sm_120 fixes" and '"sm_120 fixes"' in w["message"] for w in warned)
    kept, warned = pkgcheck.apply_overrides(problems, [{"package": "triton==3.8.0", "reason": "other version"}])
    assert len(kept) == 2 and warned == []  # the override is for another version: still a problem


def test_pkgcheck_candidates_name_who_forbids_a_version() -> None:
    from remote import pkgcheck

    dists = _dists(("torch", "2.11.0", ["triton==3.6.0"]), ("fla", "0.6.0", ["triton>=3.3"]), ("triton", "3.6.0", []))
    found = pkgcheck.check_candidates(["triton==3.7.0", "triton>=3.7"], dists, {})
    assert [p["message"] for p in found] == ["torch 2.11.0 requires triton==3.6.0; the job asks triton==3.7.0"]
