"""import_from_string: format errors, missing module/attribute, and the user's own errors."""

from __future__ import annotations

import os
import sys
import textwrap
import uuid

import pytest

from dptune.errors import ImportStringError, UsageError
from dptune.step.importer import import_from_string


@pytest.fixture
def modname():
    """A fresh module name (the import cache is per process), forgotten afterwards."""
    name = f"dptune_test_{uuid.uuid4().hex[:8]}"
    yield name
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in an empty working directory; sys.path is restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.curdir)])
    return tmp_path


def write(path, text):
    path.write_text(textwrap.dedent(text))


def test_imports_from_installed_package():
    from dptune.units import parse_bytes

    assert import_from_string("dptune.units:parse_bytes") is parse_bytes
    assert import_from_string("os.path:join") is os.path.join


def test_dotted_attribute():
    assert import_from_string("dptune.result.model:TuneResult.load").__name__ == "load"


def test_imports_from_working_directory(in_tmp, modname):
    write(in_tmp / f"{modname}.py", "class Net:\n    pass\n")
    assert str(in_tmp) not in sys.path
    net = import_from_string(f"{modname}:Net")
    assert net.__name__ == "Net"
    assert sys.path[0] == str(in_tmp)  # left there, documented


def test_imports_submodule_of_package_in_working_directory(in_tmp, modname):
    pkg = in_tmp / modname
    pkg.mkdir()
    write(pkg / "__init__.py", "")
    write(pkg / "models.py", "def make():\n    return 42\n")
    assert import_from_string(f"{modname}.models:make")() == 42


@pytest.mark.parametrize("bad", ["mymod.Net", "mymod:", ":Net", "mymod:Net:x", "my mod:Net",
                                 "mymod:Net.", "", "1mod:Net"])
def test_bad_format_names_the_string(bad):
    with pytest.raises(ImportStringError) as info:
        import_from_string(bad)
    msg = str(info.value)
    assert 'expected "module:attribute", e.g. "mymodels:Net"' in msg
    assert repr(bad) in msg


def test_format_error_is_a_usage_error():
    with pytest.raises(UsageError):
        import_from_string("mymod.Net")
    with pytest.raises(ImportStringError):
        import_from_string(None)  # type: ignore[arg-type]


def test_missing_module(in_tmp, modname):
    with pytest.raises(ImportStringError, match=f"no module named '{modname}'") as info:
        import_from_string(f"{modname}:Net")
    assert str(in_tmp) in str(info.value)
    assert info.value.__cause__ is None


def test_missing_submodule_of_existing_package():
    with pytest.raises(ImportStringError, match="no module named 'dptune.nothing_here'"):
        import_from_string("dptune.nothing_here:Net")


def test_missing_attribute_names_what_the_module_has(in_tmp, modname):
    write(in_tmp / f"{modname}.py", "class Net:\n    pass\n\ndef make_batch(n):\n    pass\n")
    with pytest.raises(ImportStringError) as info:
        import_from_string(f"{modname}:Nett")
    msg = str(info.value)
    assert f"'{modname}' has no attribute 'Nett'" in msg
    assert "did you mean 'Net'" in msg and "make_batch" in msg


def test_missing_nested_attribute(in_tmp, modname):
    write(in_tmp / f"{modname}.py", "class Net:\n    depth = 3\n")
    with pytest.raises(ImportStringError, match=f"'{modname}:Net' has no attribute 'width'"):
        import_from_string(f"{modname}:Net.width")


def test_import_error_inside_the_module_is_the_users(in_tmp, modname):
    write(in_tmp / f"{modname}.py", "import a_package_that_is_not_installed_xyz\nNet = 1\n")
    with pytest.raises(ModuleNotFoundError) as info:
        import_from_string(f"{modname}:Net")
    assert not isinstance(info.value, ImportStringError)
    assert info.value.name == "a_package_that_is_not_installed_xyz"


def test_cannot_import_name_inside_the_module_is_the_users(in_tmp, modname):
    write(in_tmp / f"{modname}.py", "from os import no_such_function_xyz\n")
    with pytest.raises(ImportError, match="no_such_function_xyz") as info:
        import_from_string(f"{modname}:Net")
    assert not isinstance(info.value, ImportStringError)


def test_other_errors_inside_the_module_pass_through(in_tmp, modname):
    write(in_tmp / f"{modname}.py", "raise RuntimeError('broken at import')\n")
    with pytest.raises(RuntimeError, match="broken at import"):
        import_from_string(f"{modname}:Net")
    write(in_tmp / f"{modname}2.py", "def f(:\n")
    with pytest.raises(SyntaxError):
        import_from_string(f"{modname}2:f")
