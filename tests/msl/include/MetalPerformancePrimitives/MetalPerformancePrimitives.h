// Stand-in for <MetalPerformancePrimitives/MetalPerformancePrimitives.h> (tensor ops subset).
#pragma once
#ifndef MSL_PARSE_ONLY
#include "../msl/msl.h"
#endif
