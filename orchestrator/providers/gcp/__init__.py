"""The `gcp` provider: GPU VMs on Compute Engine; google-cloud-compute is imported only when used."""
