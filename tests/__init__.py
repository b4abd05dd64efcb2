"""The tests, one folder per component (ARCHITECTURE.md, "Tests", says where a new one
goes): router, engines, index, policies, agent, config, bus, tenancy, loadtest, sim,
bench, deploy, service, chaos, repo. Shared by all of them: conftest (fixtures, the tier
hooks of tiers), procs (processes and ports), nats_server, kube_fake, promql, vclock,
deploy_tools, fake_vllm_pd, and data (recorded engine output)."""
