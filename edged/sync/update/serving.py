"""What the device serves, as the registry's facts say it: committed, local, or on trial."""

from __future__ import annotations

from edged.protocol.fleet.messages import ServingModel
from edged.sync.update.context import UpdateContext


def serving(ctx: UpdateContext) -> list[ServingModel]:
    out = []
    with ctx.store.lock:
        for name, ms in sorted(ctx.state.models.items()):
            p = ms.pending
            if p is not None and p.step == "trial":
                out.append(ServingModel(model=name, version=p.version, release=p.release, state="active-trial"))
            elif ms.current is not None:
                out.append(
                    ServingModel(
                        model=name,
                        version=ms.current.version,
                        release=ms.current.release,
                        state="committed" if ms.current.release else "local",
                    )
                )
    return out
