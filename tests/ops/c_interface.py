"""Reading a C file's interface, to hold the ctypes declarations of its binding module to it.

The C source is the one source of truth; each binding module mirrors its C file by hand (ctypes reads no header):
``SIGNATURES`` for every exported ``lp_*`` function, and a ``ctypes.Structure`` twin for every struct those functions
take. The interface tests (tests/ops/test_native_interface.py for the trainer's kernels,
tests/remote_ps/store/test_store_native_interface.py for the store's) compare them with what is read here, and where a C
compiler is at hand the struct layouts byte for byte (``offsetof``/``sizeof`` printed by a compiled probe).
"""
from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path
from types import ModuleType

# C scalar type -> the ctypes type that passes it; every pointer passes as a void pointer.
_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "double": ctypes.c_double, "float": ctypes.c_float}


def _text(path: Path) -> str:
    """The C file without comments, its object-like macros (``#define NAME body``, continued by backslashes) expanded:
    a struct may begin with fields its file declares once for several."""
    text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S))
    for name, body in re.findall(r"^#define[ \t]+(\w+)[ \t]+((?:[^\n]*\\\n)*[^\n]*)", text, flags=re.M):
        text = re.sub(rf"\b{name}\b", lambda _: body.replace("\\\n", " "), text)
    return text


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


def c_functions(path: Path) -> dict[str, tuple[list, object]]:
    """Every non-static ``lp_*`` function defined in ``path``: name -> (argument ctypes, result ctypes)."""
    found = {}
    for match in re.finditer(r"^(?!static)([\w \t*]+?)\b(lp_\w+)\s*\(([^)]*)\)\s*\{", _text(path), flags=re.M):
        result, name, parameters = match.groups()
        parameters = " ".join(parameters.split())
        arguments = [] if parameters in ("", "void") else [_ctype(_split_declarator(p)[0]) for p in parameters.split(",")]
        found[name] = (arguments, _ctype(result))
    return found


def c_structs(path: Path) -> dict[str, list[tuple[str, object]]]:
    """Every struct defined in ``path`` that an exported function takes a pointer to (``typedef struct {...} name_t;``):
    name -> [(field, ctypes type), ...] in order. The C code's own structs (the index's) are not read."""
    text = _text(path)
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


def python_struct(binding: ModuleType, c_name: str):
    """``find_job_t`` -> ``binding.FindJob``: the ctypes twin of a struct the exported functions take."""
    return getattr(binding, "".join(part.title() for part in c_name.removesuffix("_t").split("_")), None)


def assert_declared(path: Path, binding: ModuleType) -> None:
    """``binding.SIGNATURES`` declares exactly the functions of ``path``, each with its C signature."""
    in_c, in_python = c_functions(path), binding.SIGNATURES
    assert sorted(in_c) == sorted(in_python), (
        f"only in {path.name}: {sorted(set(in_c) - set(in_python))}; "
        f"only in {binding.__name__}.SIGNATURES: {sorted(set(in_python) - set(in_c))}")
    for name, (arguments, result) in in_c.items():
        declared_arguments, declared_result = in_python[name]
        assert list(declared_arguments) == arguments, f"{name}: {path.name} takes {arguments}, SIGNATURES says {declared_arguments}"
        assert declared_result == result, f"{name}: {path.name} returns {result}, SIGNATURES says {declared_result}"


def assert_struct_twins(path: Path, binding: ModuleType) -> None:
    """Every struct the functions of ``path`` take has a ctypes twin in ``binding`` with the same fields."""
    for c_name, fields in sorted(c_structs(path).items()):
        twin = python_struct(binding, c_name)
        assert twin is not None, f"{path.name}'s {c_name} has no ctypes Structure in {binding.__name__}"
        declared = [(field, kind) for field, kind in twin._fields_]
        assert declared == fields, f"{twin.__name__} != {path.name}'s {c_name}:\n{declared}\n{fields}"


def assert_struct_layouts(path: Path, binding: ModuleType, folder_sources: list[Path], work: Path) -> None:
    """The twins' sizes and field offsets are the C compiler's: a probe built from ``path`` (with the folder's other
    C files, for the functions it calls) prints ``offsetof``/``sizeof`` of each struct."""
    structs = c_structs(path)
    lines = [f'printf("{name} sizeof %zu\\n", sizeof({name}));' for name in structs]
    lines += [f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));' for name, fields in structs.items() for field, _ in fields]
    probe = work / "probe.c"
    probe.write_text(path.read_text() + "\n#include <stdio.h>\n#include <stddef.h>\nint main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    others = [str(p) for p in folder_sources if p.suffix == ".c" and p != path]
    built = subprocess.run(["cc", "-std=c99", "-O0", "-I", str(path.parent), "-o", str(work / "probe"), str(probe), *others, "-lm"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    printed = subprocess.run([str(work / "probe")], capture_output=True, text=True, check=True).stdout.split("\n")
    c_layout = {tuple(line.split()[:2]): int(line.split()[2]) for line in printed if line}
    for name in structs:
        twin = python_struct(binding, name)
        assert ctypes.sizeof(twin) == c_layout[(name, "sizeof")], f"{twin.__name__}: size {ctypes.sizeof(twin)} != {name}'s"
        for field, _ in twin._fields_:
            assert getattr(twin, field).offset == c_layout[(name, field)], f"{twin.__name__}.{field}: offset differs from {name}'s"
