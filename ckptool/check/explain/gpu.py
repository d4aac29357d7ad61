"""What the errors of placing a model on GPUs mean, and what to do: the
findings ``explain_findings`` gives for ``invalid-device-id``,
``dataparallel-primary-device``, ``device-mismatch`` and ``cuda-oom``,
and how ``CUDA_VISIBLE_DEVICES`` numbered the GPUs, which the
``device-unavailable`` finding tells too.

Fixes are code to paste (``model = nn.DataParallel(model, device_ids=[0, 1])``),
an environment setting, or a ``ckptool devices`` command. Pure text: no torch.
"""

from __future__ import annotations

from ckptool.check.explain import patterns as p
from ckptool.check.explain.patterns import Facts
from ckptool.check.findings import ERROR, Finding
from ckptool.describe import plural

DEVICES = "ckptool devices"  # the visible GPUs, renumbered, with their free memory
EXPORT = 'eval "$(ckptool devices --export)"'  # those GPUs, most free memory first


def listed(facts: Facts) -> list[str] | None:
    """The entries of the CUDA_VISIBLE_DEVICES the log set, or None if it set none."""
    value = facts.get("cuda_visible_devices")
    return None if value is None else [e for e in value.split(",") if e]


def visible(facts: Facts, device_count: int | None) -> int | None:
    """How many GPUs the failing process saw, from what the text or the user says."""
    if device_count is not None:
        return device_count
    entries = listed(facts)
    return None if entries is None else len(entries)


def renumbered(facts: Facts) -> str:
    """How CUDA_VISIBLE_DEVICES numbered the GPUs, where the log set it."""
    gpus = listed(facts)
    if gpus is None:
        return ""
    if not gpus:
        return "; CUDA_VISIBLE_DEVICES is empty, which hides every GPU"
    return (f"; CUDA_VISIBLE_DEVICES={facts['cuda_visible_devices']} shows "
            f"{plural(len(gpus), 'GPU')}, renumbered "
            + ", ".join(f"cuda:{i} (GPU {g})" for i, g in enumerate(gpus)))


def invalid_id(f: Facts, name: str, device_count: int | None) -> list[Finding]:
    ids, count, gpus = f.get("device_ids"), visible(f, device_count), listed(f) or []
    index = f.get("device_index")
    asked = (f"device_ids={ids}" if ids is not None
             else f"cuda:{index}" if index is not None else "a GPU index")
    highest = max(ids) if ids else index
    if count and highest is not None and highest < count:
        return [_fewer_than_said(f, asked, count, device_count is not None)]
    seen = (f"this process sees {plural(count, 'GPU')}, cuda:0 to cuda:{count - 1}"
            if count else "the index is past the GPUs this process sees")
    message = (f"{asked} names a GPU this process does not have: {seen}. GPU indices in torch "
               "(device_ids, cuda:N, set_device) count the GPUs CUDA_VISIBLE_DEVICES shows, "
               f"from 0, not the machine's GPU numbers{renumbered(f)}")
    fix: str | None = DEVICES
    snippet: str | None = "model = nn.DataParallel(model)  # every visible GPU, cuda:0 first"
    if ids and count and gpus and all(str(i) in gpus for i in ids):
        logical = [gpus.index(str(i)) for i in ids]
        message += (f": the GPUs {', '.join(map(str, ids))} are "
                    f"{', '.join(f'cuda:{i}' for i in logical)} here")
        fix = f"ckptool devices --device-ids {','.join(map(str, ids))}"  # checks the plan here
        snippet = f"model = nn.DataParallel(model, device_ids={logical})"
    elif ids:
        logical = list(range(min(len(ids), count) if count else len(ids)))
        shown = ",".join(map(str, ids))
        message += (f": number the GPUs this process sees from 0, device_ids={logical}"
                    + ("" if count else f" (`ckptool devices --device-ids {shown}` checks "
                                         "ids against the GPUs visible here)")
                    + f". Or, where this job may use the machine's GPUs "
                    f"{', '.join(map(str, ids))}, show those instead (export "
                    f"CUDA_VISIBLE_DEVICES={shown}) and keep device_ids={logical}; not under "
                    "SLURM or another scheduler, whose allocation sets CUDA_VISIBLE_DEVICES")
        fix, snippet = f"model = nn.DataParallel(model, device_ids={logical})", None
    return [Finding(p.INVALID_ID, ERROR, message, fix, snippet)]


def _fewer_than_said(f: Facts, asked: str, count: int, told: bool) -> Finding:
    """Every index asked for is below the GPUs the log or the user counts:
    the process saw fewer than that."""
    said = (f"--device-count says the process sees {plural(count, 'GPU')}" if told else
            f"CUDA_VISIBLE_DEVICES={f['cuda_visible_devices']} names "
            f"{plural(count, 'entry', 'entries')}")
    return Finding(
        p.INVALID_ID, ERROR,
        f"{asked} is within what {said}, yet CUDA refused it: the process evidently saw fewer "
        "GPUs. CUDA stops reading CUDA_VISIBLE_DEVICES at the first entry it cannot match (a "
        "GPU number the machine lacks, a UUID that is wrong or whose prefix matches two GPUs), "
        "and the process may have run with another setting than the one in the log (set in "
        "another shell, by a scheduler, or inside the script after CUDA had started). GPU "
        "indices in torch count the GPUs the process sees, from 0: print "
        "torch.cuda.device_count() in the failing process, and `ckptool devices` shows the "
        "GPUs a process started like it sees",
        DEVICES,
        "print(torch.cuda.device_count(), os.environ.get('CUDA_VISIBLE_DEVICES'))")


def primary(f: Facts, name: str, device_count: int | None) -> list[Finding]:
    first, found, ids = f["primary_device"], f["found_device"], f.get("device_ids")
    if ids:
        fix = f"model.to({first!r}); model = nn.DataParallel(model, device_ids={ids})"
    else:
        fix = f"model.to({first!r})  # before nn.DataParallel(model, device_ids=[...])"
    snippet = None
    if found != "cpu":
        at = int(found.partition(":")[2] or 0)
        if ids:
            order = [at, *(i for i in ids if i != at)]
            snippet = (f"model = nn.DataParallel(model, device_ids={order})  # {found}, "
                       "where the module is, first")
        elif at == 0:
            snippet = ("model = nn.DataParallel(model)  # every visible GPU, cuda:0 (where the "
                       "module is) first")
        else:
            snippet = (f"model = nn.DataParallel(model, device_ids=[{at}])  # {found}, where "
                       "the module is, first: list the other GPUs after it")
    return [Finding(
        p.PRIMARY, ERROR,
        f"nn.DataParallel keeps the module on device_ids[0], {first}, and copies it to the "
        f"other GPUs at every forward, so the module must be on {first} first; one of its "
        f"parameters or buffers is on {found}"
        + (" (the model was never moved to a GPU)" if found == "cpu" else
           ". A .cuda() or .to('cuda') without an index means cuda:0, also when it is called "
           "after wrapping"),
        fix, snippet)]


def mismatch(f: Facts, name: str, device_count: int | None) -> list[Finding]:
    a, b = f["devices"]
    gpu = next((d for d in (a, b) if d != "cpu"), a)
    argument = f" ({f['argument']}{' of ' + f['operation'] if 'operation' in f else ''})" \
        if "argument" in f else ""
    return [Finding(
        p.MISMATCH, ERROR,
        f"one operation got tensors on {a} and on {b}{argument}: the model and its inputs, or "
        "two parts of the model, are on different devices. Tensors stay where they were made: "
        "inputs not moved with .to(device), a tensor kept as a plain attribute instead of a "
        "buffer (model.to() does not move it), or weights loaded with map_location='cpu' and "
        "assigned by hand",
        f"model.to({gpu!r}); inputs = inputs.to({gpu!r})",
        "model.register_buffer('name', tensor)  # so that model.to() moves it")]


def oom(f: Facts, name: str, device_count: int | None) -> list[Finding]:
    gpu = f.get("gpu")
    where = f"GPU {gpu} (cuda:{gpu} in that process)" if gpu is not None else "the GPU"
    asked = f"allocating {f['requested']} on {where}" if "requested" in f else f"on {where}"
    room = f", which has {f['total']} in all and {f['free']} free" if "free" in f else ""
    snippet = None
    if f.get("during_load"):
        cause = ("It happened in torch.load, which puts every storage back on the GPU it was "
                 "saved on, all before load_state_dict copies it into the model: load to the "
                 "CPU and move the model after")
        snippet = "model.load_state_dict(torch.load(path, map_location='cpu')); model.to(device)"
    else:
        cause = ("The model, its activations and the optimizer state need more than is free: "
                 "a smaller batch, another GPU, or loading weights to the CPU first "
                 "(map_location='cpu') all help")
        if "alloc_conf" in f:
            snippet = f"export {f['alloc_conf']}  # when much memory is reserved but unused"
    return [Finding(
        p.OOM, ERROR,
        f"CUDA ran out of memory {asked}{room}. {cause}. Other processes may hold memory on "
        f"that GPU: `{DEVICES}` shows each visible GPU's free memory, and the fix below makes "
        f"the one with the most free cuda:0; `ckptool fix {name} --dtype bf16` halves an fp32 "
        "checkpoint",
        EXPORT, snippet)]
