"""The ctypes declarations of ``ops/native/__init__.py`` agree with ``kernels.c``.

The C source is the one source of truth; the Python side mirrors it by hand (ctypes reads no header). These
tests read the C prototypes of every exported ``lp_*`` function and the fields of every struct they take, and
fail naming the function or field where the two disagree. Where a C compiler is at hand, the struct layouts
are also compared byte for byte (``offsetof``/``sizeof`` printed by a compiled probe).
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from lightning_persia.ops import native
from lightning_persia.ops.native._source import SOURCE

# C scalar type -> the ctypes type that passes it; every pointer passes as a void pointer.
_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "double": ctypes.c_double, "float": ctypes.c_float}


def _source() -> str:
    """``kernels.c`` without comments."""
    text = SOURCE.read_text()
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def _ctype(declaration: str):
    """The ctypes twin of a C declaration without its name (``const int64_t *``, ``double``, ``void``)."""
    declaration = declaration.replace("const", " ").strip()
    if "*" in declaration:
        return ctypes.c_void_p
    if declaration == "void":
        return None
    return _C_TYPES[declaration]


def _split_declarator(parameter: str) -> tuple[str, str]:
    """``"const int64_t *chunks"`` -> ``("const int64_t *", "chunks")``."""
    match = re.fullmatch(r"(.*?)([A-Za-z_]\w*)", parameter.strip(), flags=re.S)
    assert match, f"cannot read the C declaration {parameter!r}"
    return match.group(1), match.group(2)


def c_functions() -> dict[str, tuple[list, object]]:
    """Every non-static ``lp_*`` function of kernels.c: name -> (argument ctypes, result ctypes)."""
    found = {}
    for match in re.finditer(r"^(?!static)([\w \t*]+?)\b(lp_\w+)\s*\(([^)]*)\)\s*\{", _source(), flags=re.M):
        result, name, parameters = match.groups()
        parameters = " ".join(parameters.split())
        arguments = [] if parameters in ("", "void") else [_ctype(_split_declarator(p)[0]) for p in parameters.split(",")]
        found[name] = (arguments, _ctype(result))
    return found


def c_structs() -> dict[str, list[tuple[str, object]]]:
    """Every struct an exported function takes a pointer to (``typedef struct {...} name_t;``): name -> [(field, ctypes
    type), ...] in order. The C code's own structs (the index's) are not read."""
    text = _source()
    structs = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        if not re.search(rf"^(?!static)[\w \t*]+\blp_\w+\s*\([^)]*\b{name}\s*\*", text, flags=re.M):
            continue
        fields = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            base, first = _split_declarator(declaration.split(",")[0])
            declarators = [(base, first)] + [(base.replace("*", "") + "*" * d.count("*"), d.replace("*", "").strip())
                                             for d in declaration.split(",")[1:]]
            fields += [(field, _ctype(kind)) for kind, field in declarators]
        structs[name] = fields
    return structs


def _python_struct(c_name: str):
    """``find_job_t`` -> ``native.FindJob``: the ctypes twin of a struct the exported functions take."""
    return getattr(native, "".join(part.title() for part in c_name.removesuffix("_t").split("_")), None)


def test_every_exported_function_is_declared_with_the_c_signature():
    in_c, in_python = c_functions(), native.SIGNATURES
    assert sorted(in_c) == sorted(in_python), (
        f"only in kernels.c: {sorted(set(in_c) - set(in_python))}; only in SIGNATURES: {sorted(set(in_python) - set(in_c))}")
    for name, (arguments, result) in in_c.items():
        declared_arguments, declared_result = in_python[name]
        assert list(declared_arguments) == arguments, f"{name}: kernels.c takes {arguments}, SIGNATURES says {declared_arguments}"
        assert declared_result == result, f"{name}: kernels.c returns {result}, SIGNATURES says {declared_result}"


def test_every_struct_the_functions_take_has_a_ctypes_twin_with_the_same_fields():
    structs = c_structs()
    assert sorted(structs) == ["admit_job_t", "find_job_t", "update_job_t"], sorted(structs)  # what the parser must see
    for c_name in sorted(structs):
        twin = _python_struct(c_name)
        assert twin is not None, f"kernels.c's {c_name} has no ctypes Structure in lightning_persia.ops.native"
        declared = [(field, kind) for field, kind in twin._fields_]
        assert declared == structs[c_name], f"{twin.__name__} != kernels.c's {c_name}:\n{declared}\n{structs[c_name]}"


def test_the_parser_reads_what_it_compares():
    """A parser that saw nothing would pass the tests above: it sees every function and every field."""
    functions = c_functions()
    assert functions["lp_uniform_rows"] == ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_double,
                                             ctypes.c_double, ctypes.c_void_p], None)
    assert functions["lp_index_new"] == ([], ctypes.c_void_p)
    fields = dict(c_structs()["update_job_t"])
    assert (fields["shift"], fields["stride"], fields["grads"], fields["lr"]) == (
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine to print the C layouts")
def test_struct_layouts_match_byte_for_byte(tmp_path):
    structs = c_structs()
    lines = [f'printf("{name} sizeof %zu\\n", sizeof({name}));' for name in structs]
    lines += [f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));' for name, fields in structs.items() for field, _ in fields]
    probe = tmp_path / "probe.c"
    probe.write_text(SOURCE.read_text() + "\n#include <stdio.h>\n#include <stddef.h>\nint main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    built = subprocess.run(["cc", "-std=c99", "-O0", "-o", str(tmp_path / "probe"), str(probe), "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    printed = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, check=True).stdout.split("\n")
    c_layout = {tuple(line.split()[:2]): int(line.split()[2]) for line in printed if line}
    for name in structs:
        twin = _python_struct(name)
        assert ctypes.sizeof(twin) == c_layout[(name, "sizeof")], f"{twin.__name__}: size {ctypes.sizeof(twin)} != {name}'s"
        for field, _ in twin._fields_:
            assert getattr(twin, field).offset == c_layout[(name, field)], f"{twin.__name__}.{field}: offset differs from {name}'s"
