"""What the gcp provider asks Compute Engine for: the VM and the firewall rule, as API requests."""

from __future__ import annotations

from orchestrator.providers.gcp.compute import compute_v1
from orchestrator.providers.gcp.names import (
    CLUSTER_LABEL,
    firewall_description,
    firewall_name,
    network_tag,
)
from orchestrator.spec import GcpProvider, PortRange

GPU_MACHINE_FAMILIES = ("a2-", "a3-", "a4-", "g2-", "g4-")  # machine types with GPUs built in


def has_gpus(config: GcpProvider) -> bool:
    return config.accelerator is not None or config.machine_type.startswith(GPU_MACHINE_FAMILIES)


def instance_properties(
    config: GcpProvider, cluster: str, zone: str, ssh_keys: str
) -> compute_v1.InstanceProperties:
    """Everything about a VM of ``cluster`` but its name, for a bulkInsert in ``zone``."""
    labels = {CLUSTER_LABEL: cluster, **config.labels}
    return compute_v1.InstanceProperties(
        machine_type=config.machine_type,
        description=f"orchestrate cluster {cluster}",
        labels=labels,
        tags=compute_v1.Tags(items=[network_tag(cluster), *config.tags]),
        metadata=compute_v1.Metadata(items=metadata_items(config, ssh_keys)),
        disks=[_boot_disk(config, labels)],
        network_interfaces=[_network_interface(config, zone)],
        guest_accelerators=_accelerators(config),
        scheduling=_scheduling(config),
        service_accounts=[
            compute_v1.ServiceAccount(email=config.service_account, scopes=list(config.scopes))
        ],
    )


def bulk_request(
    properties: compute_v1.InstanceProperties, names: list[str]
) -> compute_v1.BulkInsertInstanceResource:
    """One request for all ``names``: all of them are created, or none (min_count = count).
    Each name is a key of ``perInstanceProperties`` with an empty entry: the entry's own
    ``name`` field is documented as output only."""
    per_instance = {n: compute_v1.BulkInsertInstanceResourcePerInstanceProperties() for n in names}
    return compute_v1.BulkInsertInstanceResource(
        count=len(names), min_count=len(names), per_instance_properties=per_instance,
        instance_properties=properties,
    )


def firewall_rule(config: GcpProvider, cluster: str, ports: PortRange) -> compute_v1.Firewall:
    """The gRPC port range, open only from the cluster's VMs to the cluster's VMs (by tag)."""
    tag = network_tag(cluster)
    return compute_v1.Firewall(
        name=firewall_name(cluster),
        description=firewall_description(cluster),
        network=_network(config),
        direction="INGRESS",
        priority=1000,
        allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=[f"{ports.start}-{ports.end}"])],
        source_tags=[tag],
        target_tags=[tag],
    )


def metadata_items(config: GcpProvider, ssh_keys: str) -> list[compute_v1.Items]:
    """The instance metadata: the user's, the cluster key, guest attributes on (for host keys),
    and OS Login off for these VMs: where a project turns it on (common in organisations), the
    guest ignores ``ssh-keys`` unless the instance says FALSE (an org policy that forces OS
    Login overrides even that; ``up`` then says so)."""
    items = {**config.metadata, "ssh-keys": ssh_keys, "enable-guest-attributes": "TRUE",
             "enable-oslogin": "FALSE"}
    if has_gpus(config):
        items.setdefault("install-nvidia-driver", "True")  # Deep Learning VM images honour it
    return [compute_v1.Items(key=k, value=v) for k, v in items.items()]


def _boot_disk(config: GcpProvider, labels: dict[str, str]) -> compute_v1.AttachedDisk:
    return compute_v1.AttachedDisk(
        boot=True,
        auto_delete=True,
        initialize_params=compute_v1.AttachedDiskInitializeParams(
            source_image=config.image,
            disk_size_gb=config.disk_size_gb,
            disk_type=config.disk_type,
            labels=labels,
        ),
    )


def _network(config: GcpProvider) -> str:
    if "/" in config.network:
        return config.network
    return f"projects/{config.project}/global/networks/{config.network}"


def _network_interface(config: GcpProvider, zone: str) -> compute_v1.NetworkInterface:
    nic = compute_v1.NetworkInterface(network=_network(config))
    if config.subnetwork:
        region = zone.rsplit("-", 1)[0]
        nic.subnetwork = (config.subnetwork if "/" in config.subnetwork
                          else f"regions/{region}/subnetworks/{config.subnetwork}")
    if config.external_ip:
        nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT",
                                                      network_tier="PREMIUM")]
    return nic


def _accelerators(config: GcpProvider) -> list[compute_v1.AcceleratorConfig]:
    if config.accelerator is None:
        return []
    return [compute_v1.AcceleratorConfig(accelerator_type=config.accelerator.type,
                                         accelerator_count=config.accelerator.count)]


def _scheduling(config: GcpProvider) -> compute_v1.Scheduling:
    """GPUs cannot live-migrate: TERMINATE on host maintenance. Spot VMs stop when preempted."""
    terminate = config.spot or has_gpus(config)
    scheduling = compute_v1.Scheduling(
        on_host_maintenance="TERMINATE" if terminate else "MIGRATE",
        automatic_restart=not config.spot,
        provisioning_model="SPOT" if config.spot else "STANDARD",
    )
    if config.spot:
        scheduling.instance_termination_action = "STOP"
    return scheduling
