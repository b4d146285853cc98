"""The nvidia-ctk test stand-in (``--version`` and ``cdi generate`` only): its entry point.

Run through the launcher tests/fakes/nvidia-ctk. The real tool cannot be installed on the
test machines, so this package re-implements the parts of its behaviour the product
depends on, following the NVIDIA Container Toolkit sources (v1.17.8 .. v1.20.0:
cmd/nvidia-ctk/cdi/generate, pkg/nvcdi, internal/discover, internal/lookup, pkg/lookup).
It must fail wherever the real tool fails; it is not a "accept anything" mock.

Its modules follow NVIDIA's packages and import only those before them in this list:
version, filepath, logger, elf (no imports of the package); lookup; edits; discover;
hooks; nvml; nvcdi; libnvml; spec; knobs; cli; generate (cdi generate); this one (main).

Points mirrored on purpose:

* ``--dev-root`` defaults to ``--driver-root``; device nodes must be character devices.
* Library discovery: glob under fixed search dirs below the driver root, drop candidates
  ``os.stat`` cannot follow (dangling links), resolve with ``realpath`` in *this* process's
  mount namespace, then make paths root-relative by plain prefix stripping.  A library whose
  real path lies outside the root therefore drops out of the spec silently.
* The driver version comes from NVML when it "works", else from the file name suffix of
  ``libcuda.so.<ver>`` and then ``libnvidia-ml.so.<ver>``; neither found -> failure.
* SONAME links are only emitted (create-symlinks hook) when a symlink named like the
  library's DT_SONAME exists next to it (DT_SONAME is read from the ELF file).
* ``--output``: ``.json`` -> JSON whatever ``--format`` says, any name not ending in
  ``.yaml``/``.json`` gets the format's extension appended; written via temp file + rename.

Deliberate simplifications (documented, deterministic under tests):

* NVML: the ``libnvidia-ml.so.1`` found under the driver root is loaded (ctypes, as
  go-nvml: ``RTLD_LAZY|RTLD_GLOBAL``) and called as go-nvml calls it: it is the only
  source of GPUs. Each function is resolved as go-nvml's updateVersionedSymbols does
  (``nvmlInit_v2`` else ``nvmlInit``, ...); a library lacking one kills the process, at its
  first call, as it kills the real tool: ``<argv0>: symbol lookup error: <argv0>:
  undefined symbol: nvmlInit``, exit status 127 (the real tool is a lazily bound cgo
  binary; ``nvmlErrorString`` too, at the first error formatted, in any mode);
  ``libnvidia-sandboxutils.so.1`` without ``nvSandboxUtilsInit`` likewise. No library, or
  one that cannot be loaded: ERROR_LIBRARY_NOT_FOUND. Every other NVML error is said in
  the library's own words (its nvmlErrorString: "Driver Not Loaded", "GPU is lost").
  The first init runs in a child chrooted into an empty directory (the real library, as
  root, mknods ``/dev/nvidiactl`` in the caller's /dev; it answers 9 there, as on this
  GPU-less host); only when that answers SUCCESS (a simulated GPU machine's library,
  tests/simnvml.c, which reads its machine through a descriptor it opened when loaded)
  is the library used in this process. NVML mode then follows 1.20 call for call
  (libnvml.py): the GPUs in NVML index order, device ``i`` and its uuid with
  ``/dev/nvidia<minor>``; a GPU whose handle NVML refuses (GPU is lost) fails the whole
  generate at its index; a MIG-enabled GPU is its MIG devices ``<i>:<j>`` and MIG uuid
  with the parent's node and the GPU and compute instances' caps nodes, whose minors come
  from the HOST's ``/proc/driver/nvidia-caps/mig-minors`` as in the real tool (missing:
  every MIG device fails); ``--device-id`` as 1.20 reads it. The driver version is NVML's
  (nvmlSystemGetDriverVersion) when it initialises. NVML mode lists no IMEX channels
  (1.20 does not); management mode's ``all`` globs them. Devices are in name order, and
  device nodes and mounts in order of depth and path (1.20's spec simplifier).
* ``--mode=auto``: the real tool asks go-nvlib for the platform (NVML / Tegra / WSL) and
  falls back to nvml ("Unsupported platform detected ... assuming nvml").  Tegra and WSL are
  not simulated, so auto always resolves to nvml here, exactly as on a non-Tegra, non-WSL
  host; management mode is used only when asked for.
* The ``<root>/etc/ld.so.cache`` fallback of the library locator is not implemented.
* The hook path in the spec (``--nvidia-cdi-hook-path``) follows
  ``config.ResolveNVIDIACDIHookPath``: absolute = as given; else the first executable
  ``nvidia-cdi-hook`` (or the given name) in ``$PATH`` + the default PATH dirs, else
  ``/usr/bin/nvidia-cdi-hook`` (``nvidia-ctk``: ``/usr/bin/nvidia-ctk``, args ``nvidia-ctk
  hook ...``). Glob characters in a ``$PATH`` entry are taken literally here.
* Helper binaries are searched only below the driver root in the default PATH dirs (the
  real tool also searches ``$PATH`` and the caller's own ``/usr/bin`` etc.).
* Graphics files (EGL/Vulkan ICD json, Xorg modules), the MPS pipe dir, nvsandboxutils'
  init (loaded and checked, then reported as failing, which the real tool ignores)
  and CSV/WSL/GDS/MOFED/gdrcopy/imex/nvswitch modes are not simulated (those modes fail
  with a "not simulated" error); so do ``--library-search-path``, ``--config-search-path``,
  ``--csv.*`` and ``--feature-flag``. The DRM nodes of a GPU's PCI address (host sysfs)
  are not simulated (the simulated machines' bus ids are no PCI device of the host).
* Unknown hook names in ``--disable-hook``/``--enable-hook`` are an error here (the real
  tool ignores them silently); stricter, so a typo in the product cannot pass unnoticed.

Test knobs (environment): FAKE_NVIDIA_CTK_*, listed in knobs.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .cli import GLOBAL_FLAGS, fail_usage, parse_flags, split_global
from .knobs import KnobError, impersonated_version, log_invocation, parse_version
from .logger import CtkError, Logger, UsageError
from .version import KNOWN_COMMITS


def main(argv: Sequence[str]) -> int:
    log_invocation(argv)
    version_text = impersonated_version()
    log = Logger()
    try:
        ctk = parse_version(version_text)
        global_args, rest = split_global(argv)
        values, _, _ = parse_flags(global_args, GLOBAL_FLAGS, ctk)
        if values["debug"]:
            log = Logger("debug")
        elif values["quiet"]:
            log = Logger("error")
        if values["version"]:
            import hashlib

            commit = (
                KNOWN_COMMITS.get(version_text) or hashlib.sha1(version_text.encode()).hexdigest()
            )
            print(f"NVIDIA Container Toolkit CLI version {version_text}\ncommit: {commit}")
            return 0
        if not rest or values["help"]:
            print(
                "NAME:\n   NVIDIA Container Toolkit CLI - Tools to configure the NVIDIA "
                "Container Toolkit\n\nUSAGE:\n   nvidia-ctk [global options] command"
            )
            return 0
        if rest[:2] == ["cdi", "generate"]:
            # here, not at the top: --version and usage errors do not load discovery
            from .generate import run_generate

            return run_generate(rest[2:], ctk, log)
        sys.stderr.write(
            f"No help topic for '{' '.join(rest[:2])}' (test stand-in supports "
            "only --version and cdi generate)\n"
        )
        return 3
    except UsageError as exc:
        fail_usage(log, str(exc))
    except CtkError as exc:
        log.error(str(exc))
        return 1
    except KnobError as exc:
        sys.stderr.write(f"nvidia-ctk test stand-in: {exc}\n")
        return 2
