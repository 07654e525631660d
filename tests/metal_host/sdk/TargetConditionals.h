// Stand-in for Apple's <TargetConditionals.h> (not on Linux): says "macOS", as MLX's wheel is built.
#pragma once

#define TARGET_OS_MAC 1
#define TARGET_OS_OSX 1
#define TARGET_OS_IPHONE 0
