"""The doctor's checks of a gcp spec against Compute Engine's catalog, before any VM exists.

A boot image that is gone or retired, or a zone without the machine type or GPU, fails ``up``
only after the key pair, the firewall rule and a create request, and a wrong setting shows as
an API error then. Asked first, the catalog names the spec field, the zone and the command that
lists what there is. A zone that lacks something is only a warning while another zone of
``provider.zones`` has everything: no VM of the spec can be made there, but the others can.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.errors import ProviderError
from orchestrator.problems import Problem
from orchestrator.providers.base import CloudCheck
from orchestrator.spec import GcpProvider

if TYPE_CHECKING:  # google-cloud-compute loads in seconds: the provider imports it when asked
    from orchestrator.providers.gcp.compute import Compute

CHECK = "gcp catalog"
RETIRED = ("DEPRECATED", "OBSOLETE", "DELETED")  # an image's deprecated.state
IMAGE_PATH = re.compile(  # projects/P/global/images/NAME or .../family/F; a URL, or P left out
    r"(?:^|/)(?:projects/(?P<project>[^/]+)/)?global/images/"
    r"(?:family/(?P<family>[^/]+)|(?P<name>[^/]+))/?$")


def check(config: GcpProvider, connect: Callable[[], Compute], *, cluster: str,
          vm_names: Sequence[str], reached: Sequence[str], spec_path: Path) -> CloudCheck:
    """The catalog's problems, and the VMs of ``vm_names`` not in ``reached`` (no ``up`` has
    made them, as far as this machine knows): a problem that says so, and their names, which
    the doctor then does not try to reach over SSH.

    Args:
        connect: the API's clients, made on first use (a missing library or credentials is a
            problem too).
    """
    found = problems(config, connect)
    made = set(reached)
    unmade = tuple(n for n in vm_names if n not in made)
    if not unmade:  # the VMs exist: the catalog matters only when one has to be re-created
        found = [replace(p, blocking=False, message=f"{p.message} (the VMs exist: this matters "
                         "when one is re-created)") for p in found]
    if unmade:
        what = (f"the VMs of cluster {cluster!r}" if len(unmade) == len(vm_names)
                else f"VM(s) {', '.join(unmade)} of cluster {cluster!r}")
        found.append(Problem(
            "gcp vms", f"{what} do not exist yet (no 'up' on this machine has reached them): "
            "the doctor checks the VMs once it has",
            f"run 'orchestrate up {spec_path}' first (Cluster.up() in Python)",
            hosts=unmade))
    return CloudCheck(tuple(found), unmade)


def problems(config: GcpProvider, connect: Callable[[], Compute]) -> list[Problem]:
    """What the catalog says against ``provider.image``, ``machine_type`` and ``accelerator``;
    an API that does not answer (no permission, no network) is one blocking problem."""
    found: list[Problem] = []
    try:
        compute = connect()
        found += _image(compute, config)
        found += _zones(compute, config)
    except ProviderError as exc:
        found.append(Problem(
            CHECK, f"cannot check the Compute Engine catalog: {exc.message}",
            exc.fix or "check the credentials and the network, then run the doctor again"))
    return found


# -- the boot image ------------------------------------------------------------------------
def _image(compute: Compute, config: GcpProvider) -> list[Problem]:
    match = IMAGE_PATH.search(config.image)
    if match is None:
        return [Problem(
            CHECK, f"provider.image {config.image} is neither projects/PROJECT/global/images/NAME "
            "nor projects/PROJECT/global/images/family/FAMILY: not checked",
            "give the image in one of those forms (or its https://www.googleapis.com/compute/v1/ "
            "URL)", blocking=False)]
    project = match["project"] or config.project
    family, name = match["family"], match["name"]
    listing = f"gcloud compute images list --project {project} --no-standard-images"
    image = (compute.image_from_family(project, family) if family
             else compute.image(project, name))
    if image is None:
        what = f"no image family {family}" if family else f"no image {name}"
        describe = (f"; 'gcloud compute images describe-from-family {family} --project "
                    f"{project}' says what the family boots" if family else "")
        return [Problem(CHECK, f"provider.image {config.image} does not exist: project {project} "
                        f"has {what}", f"set provider.image to one that exists ({listing}"
                        f"{describe})")]
    shown = f"the newest image of family {family}, {image.name}," if family else "it"
    state = image.deprecated.state
    if state in RETIRED:
        replacement = image.deprecated.replacement
        fix = (f"use its replacement {replacement}" if replacement
               else f"set provider.image to a current one ({listing})")
        if state == "DEPRECATED":  # still boots, with a warning: a warning here too
            return [Problem(CHECK, f"provider.image {config.image}: {shown} is DEPRECATED: new "
                            "VMs still boot from it, until it is OBSOLETE", fix, blocking=False)]
        return [Problem(CHECK, f"provider.image {config.image}: {shown} is {state}: no new VM "
                        "can boot from it (nor can a lost VM be re-created)", fix)]
    if image.status and image.status != "READY":
        return [Problem(CHECK, f"provider.image {config.image}: {shown} is {image.status}, not "
                        "READY: no VM can boot from it now",
                        f"wait until it is READY, or set provider.image to another ({listing})")]
    return []


# -- machine type and GPUs, zone by zone ---------------------------------------------------
def _zones(compute: Compute, config: GcpProvider) -> list[Problem]:
    lacking = {zone: _lacks(compute, config, zone) for zone in config.zones}
    usable = [zone for zone, lacks in lacking.items() if not lacks]
    found = []
    for zone, lacks in lacking.items():
        for message, fix in lacks:
            if usable:
                found.append(Problem(
                    CHECK, f"{message}: no VM of this spec can be made there (it can in "
                    f"{', '.join(usable)})", f"{fix}, or remove {zone} from provider.zones",
                    blocking=False))
            else:
                found.append(Problem(CHECK, f"{message}, and no zone of provider.zones has "
                                     "everything the VMs need", fix))
    return found


def _lacks(compute: Compute, config: GcpProvider, zone: str) -> list[tuple[str, str]]:
    """(message, fix) for each thing ``zone`` lacks; none: VMs of the spec can be made there."""
    lacks = []
    if compute.machine_type(zone, config.machine_type) is None:
        lacks.append((f"zone {zone} has no machine type {config.machine_type} "
                      "(provider.machine_type)", "choose one the zone has (gcloud compute "
                      f"machine-types list --zones {zone})"))
    accelerator = config.accelerator
    if accelerator is None:
        return lacks
    found = compute.accelerator_type(zone, accelerator.type)
    if found is None:
        lacks.append((f"zone {zone} has no accelerator type {accelerator.type} "
                      "(provider.accelerator.type)", "choose one the zone has (gcloud compute "
                      f"accelerator-types list --filter=zone:{zone})"))
    elif accelerator.count > found.maximum_cards_per_instance:
        most = found.maximum_cards_per_instance
        lacks.append((f"a VM in zone {zone} takes at most {most} {accelerator.type} GPU(s), "
                      f"and provider.accelerator.count is {accelerator.count}",
                      f"set provider.accelerator.count to {most} or fewer (more workers, fewer "
                      f"GPUs each; gcloud compute accelerator-types describe {accelerator.type} "
                      f"--zone {zone} shows the limit)"))
    return lacks
