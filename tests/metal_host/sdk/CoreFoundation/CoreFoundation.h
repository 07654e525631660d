// Stand-in for Apple's <CoreFoundation/CoreFoundation.h> (not on Linux): the one type metal-cpp uses.
#pragma once

typedef double CFTimeInterval;
