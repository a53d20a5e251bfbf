// Simulator build of cuda/apa.cu (see cuda_sim.h): g++ -std=c++20 -DAPA_SIM -DAPA_D=... -shared.
#include "../apa.cu"
#include "sim_runtime.h"

static const apa_sim::Entry kTable[] = {
    APA_SIM_ENTRY(apa_prep_stats), APA_SIM_ENTRY(apa_prep_finalize), APA_SIM_ENTRY(apa_prep_k),
    APA_SIM_ENTRY(apa_prep_v),     APA_SIM_ENTRY(apa_prep_q),        APA_SIM_ENTRY(apa_pass1),
    APA_SIM_ENTRY(apa_pass2),      APA_SIM_ENTRY(apa_fused),         APA_SIM_ENTRY(apa_pass1_segment),
    APA_SIM_ENTRY(apa_prep_means), APA_SIM_ENTRY(apa_pass1_budget), APA_SIM_ENTRY(apa_pass1_segment_budget),
    APA_SIM_ENTRY(apa_fused_budget),
};
APA_SIM_EXPORT(kTable)
