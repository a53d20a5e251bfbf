// Simulator build of cuda/probe.cu (see cuda_sim.h).
#include "../probe.cu"
#include "sim_runtime.h"

static const apa_sim::Entry kTable[] = {
    APA_SIM_ENTRY(apa_probe_mma_f32), APA_SIM_ENTRY(apa_probe_mma_f16), APA_SIM_ENTRY(apa_probe_exp2),
    APA_SIM_ENTRY(apa_probe_codes),   APA_SIM_ENTRY(apa_probe_quant16), APA_SIM_ENTRY(apa_probe_tables),
    APA_SIM_ENTRY(apa_probe_pscale),  APA_SIM_ENTRY(apa_probe_merge),   APA_SIM_ENTRY(apa_probe_wgmma),
    APA_SIM_ENTRY(apa_probe_wgmma_f16), APA_SIM_ENTRY(apa_probe_budget_vote), APA_SIM_ENTRY(apa_probe_budget_beta),
};
APA_SIM_EXPORT(kTable)
