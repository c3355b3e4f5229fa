"""slotune's Kubernetes operator: SLOTuning (tune, then roll out the winner through a canary,
re-tune on a schedule) and SLOServing (render `tune serve` as Deployment + Service + ConfigMap).

Run it with `kopf run --all-namespaces --standalone -m slotune.operator.handlers`; the manifests
in `manifests/` install the CRDs, RBAC and this command as a Deployment.
"""
